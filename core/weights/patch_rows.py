"""Weight patches applied to one row slice of a weight, giving exactly those rows of the whole patched weight.

A layer streamed in row slices (``core.devices.slices``) patches each slice as it is cast. A patch applies to a
slice alone when every row of its result depends only on the same rows of the weight and of the patch's own
factors: :func:`row_multiple` says whether the patches of a weight do (and on which multiple of rows its slices
must start), :func:`patches_for_rows` restricts them to rows ``start:stop``. The restricted patches go through
the same arithmetic as the whole (``core.weights.patch_math.calculate_weight``), on row subsets that keep to the
64-row multiples matrix libraries compute identically (``core.devices.slices``), so the slice is bit for bit
the same rows of the whole patched weight (tested against the whole for every patch type).

Row-separable: diff and set (their rows), LoRA (its up factor's rows; LoCon's mid factor folds into the down
factor; DoRA when its magnitude is per output row), LoHa without Tucker factors (both up factors' rows), LoKr
with a full first factor (whole rows of it: slices on multiples of the second factor's rows), OFT without a
norm bound (whole blocks), strengths, and offsets (the rows of a narrowed part translate; on 64-row multiples).
The rest needs the whole weight, and a layer with such a patch streams whole: DoRA with a magnitude per input
column (its norm spans every row), OFT with a norm bound and BOFT (a norm over every block; butterfly stages mix
blocks), GLoRA (its layout test reads the weight's row count), LoHa with Tucker factors and LoKr with a factored
first factor (their small products are not row-split exactly), reshaped LoRA, a diff that grows the weight,
model-as-LoRA, nested patches, and any patch with a function (it may move rows).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..devices.slices import ROW_QUANTUM
from ..errors import PatchError
from .patch_math import Patch, patch_kind


@dataclass(frozen=True)
class AdapterView:
    """What ``patch_math`` reads of a weight adapter (its name and factors): an adapter restricted to some rows, or
    one whose factors were copied to the device (``core.weights.patch_factors``)."""

    name: str
    weights: tuple


def row_multiple(patches: Sequence[Patch], shape: tuple[int, ...]) -> int | None:
    """The multiple of rows on which slices of a weight of ``shape`` must start for ``patches`` to apply to each
    slice alone (1: any); ``None`` when they need the whole weight."""
    multiple = 1
    for _strength, value, _strength_model, offset, function in patches:
        space = _space(shape, offset)
        own = _multiple(value, space) if function is None and space is not None else None
        if own is None:
            return None
        if offset is not None and offset[0] == 0 and (own != 1 or offset[1] % ROW_QUANTUM or offset[2] % ROW_QUANTUM):
            return None  # a narrowed part's rows translate only when they keep to the 64-row multiples
        multiple = math.lcm(multiple, own)
    return multiple


def patches_for_rows(patches: Sequence[Patch], start: int, stop: int) -> list[Patch]:
    """``patches`` restricted to rows ``start:stop`` of their weight (which :func:`row_multiple` allowed)."""
    restricted = []
    for strength, value, strength_model, offset, function in patches:
        if offset is None or offset[0] != 0:
            restricted.append((strength, _rows_of(value, start, stop), strength_model, offset, function))
            continue
        low, high = max(start, offset[1]), min(stop, offset[1] + offset[2])
        if low < high:  # the part of the weight this patch narrows to has rows in this slice
            part = _rows_of(value, low - offset[1], high - offset[1])
            restricted.append((strength, part, strength_model, (0, low - start, high - low), function))
    return restricted


def _space(shape: tuple[int, ...], offset: Any) -> tuple[int, ...] | None:
    """The shape of what a patch changes: the weight, or the part its offset narrows it to."""
    if offset is None:
        return shape
    dim, start, length = offset
    if not 0 <= dim < len(shape) or start + length > shape[dim]:
        return None
    return (*shape[:dim], length, *shape[dim + 1 :])


def _kind(value: Any) -> str | None:
    try:
        return patch_kind(value)
    except PatchError:
        return None


def _multiple(value: Any, space: tuple[int, ...]) -> int | None:
    kind = _kind(value)
    if kind in ("diff", "set"):
        tensor = _payload(value)[0]
        return 1 if tuple(tensor.shape) == space else None
    rule = _ADAPTER_RULES.get(kind or "")
    return rule(value.weights, space) if rule is not None else None


def _rows_of(value: Any, start: int, stop: int) -> Any:
    kind = patch_kind(value)
    if kind == "diff" and len(value) == 1:
        return (value[0][start:stop],)
    if kind in ("diff", "set"):
        payload = _payload(value)
        return (value[0], (payload[0][start:stop], *payload[1:]))
    return AdapterView(kind, _ADAPTER_ROWS[kind](value.weights, start, stop))


def _payload(value: tuple) -> tuple:
    """The tensors of a diff or set patch: ``(diff,)``, or the payload of ``(kind, payload)``."""
    return value if len(value) == 1 else value[1]


def _per_row(dora: torch.Tensor | None, space: tuple[int, ...]) -> bool:
    """Whether a DoRA magnitude (if any) is per output row: its norm then spans each row alone."""
    return dora is None or dora.shape[0] == space[0]


def _cut(tensor: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    return None if tensor is None else tensor[start:stop]


def _lora_multiple(w: tuple, space: tuple[int, ...]) -> int | None:
    up, _down, _alpha, _mid, dora, reshape = w
    return 1 if reshape is None and up.shape[0] == space[0] and _per_row(dora, space) else None


def _lora_rows(w: tuple, start: int, stop: int) -> tuple:
    up, down, alpha, mid, dora, reshape = w
    return (up[start:stop], down, alpha, mid, _cut(dora, start, stop), reshape)


def _loha_multiple(w: tuple, space: tuple[int, ...]) -> int | None:
    w1a, _w1b, _alpha, w2a, _w2b, t1, t2, dora = w
    plain = t1 is None and t2 is None and w1a.shape[0] == w2a.shape[0] == space[0]
    return 1 if plain and _per_row(dora, space) else None


def _loha_rows(w: tuple, start: int, stop: int) -> tuple:
    w1a, w1b, alpha, w2a, w2b, t1, t2, dora = w
    return (w1a[start:stop], w1b, alpha, w2a[start:stop], w2b, t1, t2, _cut(dora, start, stop))


def _lokr_second_rows(w: tuple) -> int:
    """Rows of a LoKr's second Kronecker factor: given, a product, or a Tucker expansion."""
    _w1, w2, _alpha, _w1a, _w1b, w2a, _w2b, t2, _dora = w
    if w2 is not None:
        return w2.shape[0]
    return w2a.shape[0] if t2 is None else w2a.shape[1]


def _lokr_multiple(w: tuple, space: tuple[int, ...]) -> int | None:
    w1, dora = w[0], w[8]
    if w1 is None or not _per_row(dora, space):
        return None
    second = _lokr_second_rows(w)
    return second if w1.shape[0] * second == space[0] else None


def _lokr_rows(w: tuple, start: int, stop: int) -> tuple:
    w1, w2, alpha, w1a, w1b, w2a, w2b, t2, dora = w
    second = _lokr_second_rows(w)
    return (w1[start // second : stop // second], w2, alpha, w1a, w1b, w2a, w2b, t2, _cut(dora, start, stop))


def _oft_multiple(w: tuple, space: tuple[int, ...]) -> int | None:
    blocks, _rescale, alpha, dora = w
    count, size = blocks.shape[:2]
    return size if not (alpha or 0) > 0 and count * size == space[0] and _per_row(dora, space) else None


def _oft_rows(w: tuple, start: int, stop: int) -> tuple:
    blocks, rescale, alpha, dora = w
    size = blocks.shape[1]
    return (blocks[start // size : stop // size], rescale, alpha, _cut(dora, start, stop))


_ADAPTER_RULES: dict[str, Callable[[tuple, tuple[int, ...]], int | None]] = {
    "lora": _lora_multiple,
    "loha": _loha_multiple,
    "lokr": _lokr_multiple,
    "oft": _oft_multiple,
}
_ADAPTER_ROWS: dict[str, Callable[[tuple, int, int], tuple]] = {
    "lora": _lora_rows,
    "loha": _loha_rows,
    "lokr": _lokr_rows,
    "oft": _oft_rows,
}
