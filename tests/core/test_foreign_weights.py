"""Weights another pack keeps in a tensor class of its own (``core.weights.foreign``): ComfyUI-GGUF's tensors are
recognised by their attributes, so Move To GPU and Split Model can refuse them before a copy loses what the
class carries. The subclass here stands in for ComfyUI-GGUF's (a plain tensor plus the two attributes its
``GGMLTensor`` carries); ``tests/integration/test_comfyui_gguf.py`` runs the pack itself where it is installed."""

from __future__ import annotations

import torch

from core.weights.foreign import foreign_quantized


class MarkedTensor(torch.Tensor):
    """A tensor carrying a GGML type and the weight's logical shape, as ComfyUI-GGUF's tensors do."""

    tensor_type = 8
    tensor_shape = torch.Size((4, 32))


def test_a_parameter_of_another_packs_quantised_class_is_named():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(32, 4))
    blocks = torch.zeros(4, 34, dtype=torch.uint8).as_subclass(MarkedTensor)
    model[1].weight = torch.nn.Parameter(blocks, requires_grad=False)
    assert foreign_quantized(model) == "1.weight"


def test_plain_and_our_own_quantised_weights_are_not():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model[0].weight = torch.nn.Parameter(torch.zeros(4, 34, dtype=torch.uint8), requires_grad=False)  # our blocks
    assert foreign_quantized(model) is None
