"""Weights another pack keeps in a tensor class of its own (``core.weights.foreign``): ComfyUI-GGUF's tensors are
recognised by their attributes and turned into our own form (the same bytes, read by our cast layers), against the
GGML project's ``gguf`` package dequantising the same blocks. The subclass here stands in for ComfyUI-GGUF's (a
plain tensor plus the two attributes its ``GGMLTensor`` carries); ``tests/integration/test_comfyui_gguf.py`` runs
the pack itself where it is installed."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from core.detection.ggml_types import ggml_type
from core.errors import ModelFileError
from core.weights.foreign import foreign_quantized, own_foreign_quantized
from core.weights.ops import convert
from core.weights.quantized import layout_of


class MarkedTensor(torch.Tensor):
    """A tensor carrying a GGML type and the weight's logical shape, as ComfyUI-GGUF's tensors do."""

    tensor_type = 8
    tensor_shape = torch.Size((4, 32))

    def detach(self, *args, **kwargs):  # as ComfyUI-GGUF's: a parameter made of it keeps the instance's attributes
        return self


def _marked(raw: torch.Tensor, ggml_id: int, shape: tuple[int, ...]) -> torch.nn.Parameter:
    tensor = raw.as_subclass(MarkedTensor)
    tensor.tensor_type, tensor.tensor_shape = ggml_id, torch.Size(shape)
    return torch.nn.Parameter(tensor, requires_grad=False)


def _kind(ggml_id: int, name: str):
    return ggml_type(ggml_id, name)


def test_a_parameter_of_another_packs_quantised_class_is_named():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(32, 4))
    blocks = torch.zeros(4, 34, dtype=torch.uint8).as_subclass(MarkedTensor)
    model[1].weight = torch.nn.Parameter(blocks, requires_grad=False)
    assert foreign_quantized(model) == "1.weight"


def test_plain_and_our_own_quantised_weights_are_not():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model[0].weight = torch.nn.Parameter(torch.zeros(4, 34, dtype=torch.uint8), requires_grad=False)  # our blocks
    assert foreign_quantized(model) is None


def test_their_blocks_become_ours_over_the_same_bytes_and_compute_as_gguf_dequantises_them():
    values = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    blocks = torch.from_numpy(gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0))  # (8, 68) bytes
    layer = torch.nn.Linear(64, 8)
    layer.weight = _marked(blocks, 8, (8, 64))
    layer.bias = _marked(torch.ones(8), 0, (8,))  # F32: a plain float parameter
    model = torch.nn.Sequential(layer)
    assert own_foreign_quantized(model, _kind) == {layer}
    assert foreign_quantized(model) is None and layout_of(layer, "weight") is not None
    assert layer.weight.untyped_storage().data_ptr() == blocks.untyped_storage().data_ptr()  # nothing copied
    assert type(layer.bias) is torch.nn.Parameter and layer.bias.shape == (8,)
    convert(model)
    x = torch.randn(3, 64)
    expected = x @ torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType.Q8_0)).T + 1
    assert torch.allclose(model(x), expected, rtol=1e-6, atol=1e-5)


def test_a_tied_weight_stays_tied_and_an_unread_type_is_named():
    shared = _marked(torch.zeros(4, 34, dtype=torch.uint8), 8, (4, 32))
    first, second = torch.nn.Linear(32, 4, bias=False), torch.nn.Linear(32, 4, bias=False)
    first.weight = second.weight = shared
    model = torch.nn.Sequential(first, second)
    own_foreign_quantized(model, _kind)
    assert first.weight is second.weight and layout_of(second, "weight") == layout_of(first, "weight")
    odd = torch.nn.Sequential(torch.nn.Linear(32, 4, bias=False))
    odd[0].weight = _marked(torch.zeros(4, 34, dtype=torch.uint8), 16, (4, 32))  # IQ2_XXS
    with pytest.raises(ModelFileError, match=r"0\.weight is stored in GGML type 16"):
        own_foreign_quantized(odd, _kind)
