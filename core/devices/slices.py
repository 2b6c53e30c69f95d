"""Streaming a weight in row slices: which layers can, where their slices fall, and what crosses at once.

A streamed layer whose weight is larger than the streaming unit its budget allows crosses to the device in
slices of whole output rows (a Linear's rows, a convolution's output channels), each copied, cast and patched
just before the output rows it computes, so the device holds one slice of it at a time, never the whole weight.
The output rows of a Linear or a convolution depend on the weight's rows of the same index only, so the slices
compute what the whole weight computes.

**Where slices fall.** Every slice holds a multiple of :data:`ROW_QUANTUM` rows (a patch may ask for a larger
multiple, e.g. an OFT block), at most the unit's bytes, and the slices of one weight are as even as the
multiple allows. Matrix libraries compute an output element the same way whatever the width of the output they
are asked for when that width, and the whole's, keep to their blocking and to how they split the work between
threads: widths in multiples of 64 do (checked bit for bit on the host's library, ``tests/core/test_slices.py``),
odd ones do not always (a whole of 650 rows computes its last rows with other kernels than 64-row slices do).
So only a weight whose row count is a multiple of 64 streams in slices; the others (rare, and small: a final
projection to a few channels) stream whole.

The placement engine marks a layer that streams in slices with :data:`SLICES` (its :class:`RowSlices`); the
cast layers (``core.weights``) read the mark, the prefetch (``core.placement.prefetch``) copies ahead slice by
slice. A layer type that computes in slices says so with :data:`SLICEABLE`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: A slice holds a multiple of this many rows (see the module's docstring for why 64).
ROW_QUANTUM = 64

#: The attribute a streamed layer carries while it streams in slices: its :class:`RowSlices`.
SLICES = "device_control_slices"

#: A layer whose class (or instance) sets this true computes in row slices when it carries :data:`SLICES`.
SLICEABLE = "device_control_sliceable"

#: A layer whose tensors take more device bytes made ready to compute than stored (a quantised layer's, decoded
#: by ``core.weights.quantized``) keeps here a function ``(layer, nbytes, rows) -> bytes`` (:func:`ready_bytes`).
READY_BYTES = "device_control_ready_bytes"


@dataclass(frozen=True)
class RowSlices:
    """Where a weight's row slices fall: ``bounds`` are the first row of each slice, then the row count."""

    bounds: tuple[int, ...]

    def ranges(self) -> list[tuple[int, int]]:
        """``(start, stop)`` of every slice, in order."""
        return list(zip(self.bounds[:-1], self.bounds[1:], strict=True))

    @property
    def largest(self) -> int:
        """Rows of the largest slice."""
        return max(stop - start for start, stop in self.ranges())

    def aligned_to(self, multiple: int) -> bool:
        """Whether every slice starts on a multiple of ``multiple`` rows (the last one ends at the row count)."""
        return all(bound % multiple == 0 for bound in self.bounds[:-1])


def row_geometry(module: torch.nn.Module) -> tuple[int, int] | None:
    """``(rows, bytes per row)`` of the weight of a layer that can compute in row slices; ``None`` otherwise."""
    if not getattr(module, SLICEABLE, False):
        return None
    weight = module._parameters.get("weight")
    if weight is None or weight.dim() < 2 or weight.size(0) % ROW_QUANTUM:
        return None
    return weight.size(0), weight[0].numel() * weight.element_size()


def ready_bytes(module: torch.nn.Module, nbytes: int, rows: int | None = None) -> int:
    """The device bytes a streamed piece of ``module`` (``nbytes`` of its stored bytes: all of them, or the first
    ``rows`` of its weight and its other tensors) takes once made ready to compute: ``nbytes``, unless the layer
    says otherwise under :data:`READY_BYTES`."""
    measure = module.__dict__.get(READY_BYTES)
    return nbytes if measure is None else measure(module, nbytes, rows)


def row_slices(rows: int, row_bytes: int, unit: int, multiple: int, extra: int = 0) -> RowSlices | None:
    """The slices that stream a weight of ``rows`` rows of ``row_bytes`` each within ``unit`` bytes.

    Args:
        rows: the weight's rows.
        row_bytes: bytes of one row.
        unit: the most bytes that may cross for one slice, with ``extra``.
        multiple: every slice starts on a multiple of this many rows.
        extra: bytes that cross with the first slice and stay while the layer computes (its bias).

    Returns:
        The slices, each of at most ``unit`` bytes with ``extra`` where one ``multiple`` of rows fits in it, else
        of one ``multiple``; ``None`` when that would be the whole weight (it then streams whole).
    """
    fits = max(0, unit - extra) // max(1, row_bytes)
    per = max(multiple, fits // multiple * multiple)
    if per >= rows:
        return None
    count = math.ceil(rows / per)
    size = math.ceil(math.ceil(rows / count) / multiple) * multiple  # as even as the multiple allows, <= per
    return RowSlices((*range(0, rows, size), rows))
