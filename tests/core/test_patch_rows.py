"""On-the-fly patches of a weight streamed in row slices: each slice patched alone is bit for bit the same rows of
the whole weight patched, for every patch type that separates by rows; the others are said to need the whole
weight (the layer then streams whole). ``integration/test_patch_oracle.py`` checks the same against ComfyUI's
own patch math and adapter classes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from core.devices.slices import ROW_QUANTUM, row_slices
from core.weights.patch_rows import row_multiple
from core.weights.patching import OnTheFlyPatch

LINEAR, CONV = (256, 96), (128, 16, 3, 3)


def randn(*shape: int, scale: float = 0.1) -> torch.Tensor:
    return torch.randn(*shape) * scale


def adapter(name: str, *weights) -> SimpleNamespace:
    """What the patch math reads of an adapter: its name and factors (ComfyUI's classes carry the same)."""
    return SimpleNamespace(name=name, weights=weights)


def patch(value, strength=1.0, strength_model=1.0, offset=None, function=None) -> list:
    return [(strength, value, strength_model, offset, function)]


def separable() -> dict[str, tuple[tuple[int, ...], list]]:
    """name -> (weight shape, patches) for every patch that separates by rows."""
    torch.manual_seed(11)
    out, inp, rank = LINEAR[0], LINEAR[1], 8
    lora = adapter("lora", randn(out, rank), randn(rank, inp), 4.0, None, None, None)
    return {
        "lora": (LINEAR, patch(lora, 0.7)),
        "lora-conv-mid": (
            CONV,
            patch(adapter("lora", randn(128, 4, 1, 1), randn(4, 16, 1, 1), 2.0, randn(4, 4, 3, 3), None, None)),
        ),
        "lora-dora-rows": (
            LINEAR,
            patch(adapter("lora", randn(out, rank), randn(rank, inp), 4.0, None, randn(out, 1).abs() + 1, None), 0.6),
        ),
        "lora-dora-rows-full-strength": (
            LINEAR,
            patch(adapter("lora", randn(out, rank), randn(rank, inp), 4.0, None, randn(out, 1).abs() + 1, None)),
        ),
        "loha": (
            LINEAR,
            patch(
                adapter(
                    "loha", randn(out, rank), randn(rank, inp), 4.0, randn(out, rank), randn(rank, inp), *[None] * 3
                )
            ),
        ),
        "lokr-full": (LINEAR, patch(adapter("lokr", randn(4, 2), randn(64, 48), None, *[None] * 6))),
        "lokr-second-factored": (
            LINEAR,
            patch(adapter("lokr", randn(4, 2), None, 2.0, None, None, randn(64, 2), randn(2, 48), None, None)),
        ),
        "oft": (LINEAR, patch(adapter("oft", randn(16, 16, 16), None, 0.0, None), 0.8)),
        "diff": (LINEAR, patch((randn(out, inp),), 0.5)),
        "diff-named": (LINEAR, patch(("diff", (randn(out, inp), {"pad_weight": False})), 0.5)),
        "set": (LINEAR, patch(("set", (randn(out, inp),)))),
        "strength-model": (LINEAR, patch((randn(out, inp),), 0.5, 0.9)),
        "offset-rows": (
            LINEAR,
            patch(adapter("lora", randn(128, 4), randn(4, inp), 4.0, *[None] * 3), offset=(0, 64, 128)),
        ),
        "offset-columns": (LINEAR, patch((randn(out, 32),), 0.5, offset=(1, 16, 32))),
        "qkv-offsets": (
            LINEAR,
            patch((randn(128, inp),), offset=(0, 0, 128)) + patch((randn(64, inp),), 0.3, offset=(0, 128, 64)),
        ),
        "chain": (LINEAR, patch((randn(out, inp),)) + patch(lora, 0.3)),
    }


def whole_weight(shape: tuple[int, ...], storage: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(3)).to(storage)


@pytest.mark.parametrize("storage", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(separable()))
def test_each_slice_patched_alone_is_those_rows_of_the_whole_patched(name, storage):
    shape, patches = separable()[name]
    weight = whole_weight(shape, storage)
    function = OnTheFlyPatch("w", {"w": patches}, storage_dtype=storage)
    multiple = function.slice_multiple(shape)
    assert multiple is not None, name
    whole = function(weight.to(torch.float32))
    assert not torch.equal(whole, weight.to(torch.float32)), name  # it did patch
    slices = row_slices(shape[0], math.prod(shape[1:]) * 4, 1, math.lcm(ROW_QUANTUM, multiple))
    assert slices is not None and len(slices.ranges()) > 1
    for start, stop in slices.ranges():
        rows = function.rows(weight[start:stop].to(torch.float32), start, stop)
        assert rows.dtype == whole.dtype and torch.equal(rows, whole[start:stop]), (name, start, stop)


def not_separable() -> dict[str, tuple[tuple[int, ...], list, torch.dtype]]:
    """name -> (weight shape, patches, storage) for patches that need the whole weight."""
    torch.manual_seed(12)
    out, inp = LINEAR
    lora = adapter("lora", randn(out, 4), randn(4, inp), 4.0, None, None, None)
    return {
        "dora-columns": (
            LINEAR,
            patch(adapter("lora", randn(out, 4), randn(4, inp), 4.0, None, randn(1, inp).abs() + 1, None)),
            torch.float32,
        ),
        "oft-norm-bound": (LINEAR, patch(adapter("oft", randn(16, 16, 16), None, 0.5, None)), torch.float32),
        "boft": (LINEAR, patch(adapter("boft", randn(2, 16, 16, 16), None, 1.0, None)), torch.float32),
        "glora": (LINEAR, patch(adapter("glora", *(randn(2, 2),) * 4, 1.0, None)), torch.float32),
        "loha-tucker": (
            CONV,
            patch(
                adapter(
                    "loha",
                    randn(4, 128),
                    randn(4, 16),
                    4.0,
                    randn(4, 128),
                    randn(4, 16),
                    *[randn(4, 4, 3, 3)] * 2,
                    None,
                )
            ),
            torch.float32,
        ),
        "lokr-first-factored": (
            LINEAR,
            patch(adapter("lokr", None, randn(64, 48), 2.0, randn(4, 2), randn(2, 2), *[None] * 4)),
            torch.float32,
        ),
        "lora-reshape": (
            LINEAR,
            patch(adapter("lora", randn(out, 4), randn(4, inp), 4.0, None, None, [out, inp])),
            torch.float32,
        ),
        "diff-that-grows": (LINEAR, patch(("diff", (randn(out + 64, inp), {"pad_weight": True}))), torch.float32),
        "function": (LINEAR, patch((randn(out, inp),), function=lambda t: t.flip(0)), torch.float32),
        "nested": (LINEAR, patch([(randn(out, inp), lambda t, inplace: t)]), torch.float32),
        "model-as-lora": (LINEAR, patch(("model_as_lora", (randn(out, inp),))), torch.float32),
        "offset-off-the-64-rows": (LINEAR, patch((randn(100, inp),), offset=(0, 10, 100)), torch.float32),
        "fp8-storage": (LINEAR, patch(lora), torch.float8_e4m3fn),
    }


@pytest.mark.parametrize("name", list(not_separable()))
def test_patches_that_need_every_row_say_so(name):
    shape, patches, storage = not_separable()[name]
    assert OnTheFlyPatch("w", {"w": patches}, storage_dtype=storage).slice_multiple(shape) is None
    assert OnTheFlyPatch("w", {"w": patches}).slice_multiple(shape) is None  # a weight in a special form neither


def test_the_multiple_is_the_one_every_patch_of_the_weight_needs():
    oft = patch(adapter("oft", randn(16, 16, 16), None, 0.0, None))
    lokr = patch(adapter("lokr", randn(2, 2), randn(128, 48), None, *[None] * 6))
    assert row_multiple(oft, LINEAR) == 16 and row_multiple(lokr, LINEAR) == 128
    assert row_multiple(oft + lokr, LINEAR) == 128 and row_multiple([], LINEAR) == 1
