"""Writing large synthetic model files: streamed tensor by tensor, atomically, cached by a version stamp.

The family fixtures (:mod:`tools.make_family_fixtures`) include an SDXL-class UNet (849 M parameters, 1.7 GB in
fp16; the GPU benchmark's full-size one: 2.57 B, 5.1 GB). Holding one in memory to hand it to
``safetensors.save_file`` would cost more RAM than a shared CI machine has to spare, so we write the safetensors
format ourselves: the header first (every name, dtype and shape is known from a model built on torch's ``meta``
device), then each tensor's bytes as it is generated. Peak memory is the largest single tensor.

The values follow the same rule as the SD1.5 fixtures: N(0, 0.02) for matrices and kernels, 1 for norm
scales, 0 for biases, seeded, so that a model computes something finite and non-degenerate. One refinement:
norm scales stored with more than one dimension (the Wan VAE's ``gamma``, shaped ``[C, 1, 1, 1]``) are ones
too, where a rule on dimensions alone would make them tiny random numbers and silence every layer after them.
"""

from __future__ import annotations

import json
import logging
import math
import re
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from core.detection.headers import SAFETENSORS_DTYPES
from tools.layouts import layouts, write_sparse_safetensors

log = logging.getLogger("device_control.tools")

#: The safetensors metadata key holding a fixture's version stamp (the SD1.5 fixtures use the same key).
STAMP_KEY = "device_control_fixture"
#: What floating-point tensors are written as.
FIXTURE_DTYPE = torch.float16
_DTYPE_NAMES = {dtype: name for name, (_, dtype) in SAFETENSORS_DTYPES.items() if dtype is not None}
#: A norm's scale: the last name part is ``gamma`` or ``scale``, or the module is a norm (``norm1``, ``ln_q``,
#: ``layer_norm2``, ``key_norm``, ``norms.3``).
_NORM_SCALE = re.compile(r"(^|\.)(gamma|scale)$|(^|\.|_)(norm\w*|ln_\w+|norms\.\d+)\.weight$")


class FixtureMismatchError(RuntimeError):
    """ComfyUI does not see a generated layout as the model it was meant to be."""


def is_current(path: Path, stamp: str) -> bool:
    """Whether ``path`` is a complete fixture written with version ``stamp`` (a foreign or torn file is not)."""
    if not path.exists():
        return False
    try:
        with safe_open(str(path), "pt") as handle:
            return (handle.metadata() or {}).get(STAMP_KEY) == stamp
    except Exception:  # a truncated or foreign file is rebuilt
        return False


def is_norm_scale(name: str) -> bool:
    """Whether ``name`` is a normalisation layer's scale (written as ones, whatever its shape)."""
    return bool(_NORM_SCALE.search(name))


def fill(name: str, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The synthetic value of tensor ``name`` shaped like ``like``: see the module docstring for the rule.

    Integer buffers (CLIP's position ids) get 0, 1, 2, ... so they keep their meaning.
    """
    if not like.dtype.is_floating_point:
        return torch.arange(like.numel(), dtype=like.dtype).reshape(like.shape)
    if name.endswith("bias"):
        return torch.zeros(like.shape, dtype=FIXTURE_DTYPE)
    if is_norm_scale(name) or like.dim() < 2:
        return torch.ones(like.shape, dtype=FIXTURE_DTYPE)
    return (torch.randn(like.shape, generator=generator) * 0.02).to(FIXTURE_DTYPE)


def _stored_dtype(like: torch.Tensor) -> torch.dtype:
    return FIXTURE_DTYPE if like.dtype.is_floating_point else like.dtype


def _header(layout: Mapping[str, torch.Tensor], metadata: dict[str, str], stored: Callable[..., torch.dtype]) -> bytes:
    """The safetensors header for ``layout`` in sorted name order, padded to 8 bytes as writers do."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in sorted(layout):
        dtype = _DTYPE_NAMES[stored(layout[name])]
        size = math.prod(layout[name].shape) * SAFETENSORS_DTYPES[dtype][0]
        header[name] = {"dtype": dtype, "shape": list(layout[name].shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def _write(
    target: Path,
    layout: Mapping[str, torch.Tensor],
    metadata: dict[str, str],
    value: Callable[[str], torch.Tensor],
    stored: Callable[..., torch.dtype],
) -> Path:
    """Write the header of ``layout``, then ``value(name)`` of each tensor in header order, atomically.

    The file appears under its name only once complete (written beside it, then renamed), so an interrupted
    run leaves no torn fixture behind; :func:`is_current` would rebuild one anyway. The bytes depend only on
    the layout, the metadata and the values (``safetensors.save_file`` orders metadata at random).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    with open(partial, "wb") as handle:
        raw = _header(layout, metadata, stored)
        handle.write(struct.pack("<Q", len(raw)))
        handle.write(raw)
        for name in sorted(layout):
            data = value(name)
            if data.dtype != stored(layout[name]) or data.shape != layout[name].shape:
                raise ValueError(f"{name}: {data.dtype} {tuple(data.shape)} does not match the header")
            handle.write(data.contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy
    partial.replace(target)
    log.info("[Device Control] wrote %s (%d tensors)", target, len(layout))
    return target


def write_streamed(target: Path, layout: Mapping[str, torch.Tensor], metadata: dict[str, str], seed: int) -> Path:
    """Write ``layout`` (meta tensors) to ``target`` with synthetic values (:func:`fill`), one tensor at a time."""
    generator = torch.Generator().manual_seed(seed)
    return _write(target, layout, metadata, lambda name: fill(name, layout[name], generator), _stored_dtype)


def write_small(target: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """Write a small file (a LoRA) from tensors in memory, as they are, atomically."""
    return _write(target, tensors, metadata, tensors.__getitem__, lambda like: like.dtype)


def write_sparse(target: Path, layout_name: str, metadata: dict[str, str]) -> Path:
    """Write the real layout ``layout_name`` of ``tests/data`` as a sparse file (a header, then a hole)."""
    partial = target.with_name(target.name + ".partial")
    write_sparse_safetensors(layouts()[layout_name], partial, metadata)
    partial.replace(target)
    log.info("[Device Control] wrote %s (sparse, layout %s)", target, layout_name)
    return target


def hollow(path: Path, block: int = 1 << 16) -> Path:
    """Rewrite ``path`` with its all-zero blocks as holes: a file whose unused rows are zeros (an embedding no
    prompt reaches) then takes on disk only what it holds, and reads back the same."""
    partial = path.with_name(path.name + ".hollow")
    with open(path, "rb") as source, open(partial, "wb") as target:
        while chunk := source.read(block):
            if chunk.count(0) == len(chunk):
                target.seek(len(chunk), 1)
            else:
                target.write(chunk)
        target.truncate()
    partial.replace(path)
    return path


def layout_on_meta(layout_name: str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A real layout of ``tests/data`` as meta tensors (its own dtypes, or ``dtype`` for every tensor)."""
    tensors = layouts()[layout_name]["tensors"]
    return {
        name: torch.empty(shape, dtype=dtype or SAFETENSORS_DTYPES[stored][1], device="meta")
        for name, (shape, stored) in tensors.items()
    }


def file_on_meta(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors as meta tensors of the right shape and dtype (only the header is read)."""
    with safe_open(str(path), "pt") as handle:
        views = {name: handle.get_slice(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
        return {
            name: torch.empty(view.get_shape(), dtype=SAFETENSORS_DTYPES[view.get_dtype()][1], device="meta")
            for name, view in views.items()
        }


def same_shapes(ours: Mapping[str, torch.Tensor], theirs: Mapping[str, Any]) -> list[str]:
    """What differs between two layouts: names only one has, and names whose shapes differ (empty: the same)."""
    problems = [f"only in ours: {name}" for name in sorted(set(ours) - set(theirs))]
    problems += [f"missing from ours: {name}" for name in sorted(set(theirs) - set(ours))]
    for name in sorted(set(ours) & set(theirs)):
        shape = theirs[name].shape if hasattr(theirs[name], "shape") else theirs[name]
        if tuple(ours[name].shape) != tuple(shape):
            problems.append(f"{name}: {tuple(ours[name].shape)} here, {tuple(shape)} there")
    return problems
