"""How a streamed layer crosses to its device, in *pieces*, and the streaming reserve those pieces need.

A piece is what crosses at once: a whole streamed layer, or one row slice of a layer larger than the streaming unit
(``core.devices.slices``). While a piece computes, it is on the device once as stored and once made ready to
compute, and the next piece is copied ahead: the reserve is :data:`STREAM_COPIES` times the largest streamed piece
(more for a quantised piece, decoded on the device into more bytes than it crosses in).

**Slices no finer than the reserve needs.** The reserve is set by the largest streamed piece, so slicing the other
layers finer than that piece saves no device memory and costs a copy, an event and a wait per slice (at a budget
of 0, SD1.5's attention projections crossed in slices of 64 rows while a convolution's 64 rows set a reserve
eighteen times larger). :func:`widened` slices the streamed layers again with the largest piece as the unit, where
that leaves the reserve as it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..devices.slices import ROW_QUANTUM, RowSlices, ready_bytes, row_slices
from .slabs import aligned, groupable, layer_bytes

if TYPE_CHECKING:
    import torch


class Layer(Protocol):
    """What slicing reads of a layer (``core.placement.plan.Layer`` is one): its name, its module, its bytes, and
    its rows with the bytes of each (``rows`` is 0 for a layer that cannot stream in row slices)."""

    name: str
    module: torch.nn.Module
    nbytes: int
    rows: int
    row_bytes: int


#: While a streamed piece computes, its weights are on the device once in their stored dtype and once in the
#: compute dtype (twice the bytes when fp16 computes in fp32), and the next piece is copied ahead: room for that
#: many of the largest streamed piece is kept inside the budget (the streaming reserve). A quantised piece made
#: ready to compute takes more than its stored bytes (:func:`stream_reserve`).
STREAM_COPIES = 3


def stream_reserve(piece: int, ready: int) -> int:
    """The streaming reserve for streamed pieces of at most ``piece`` stored bytes that take at most ``ready``
    bytes once made ready to compute (``core.devices.slices.ready_bytes``): the piece computing and the one
    copied ahead as stored, and one made ready. For plain weights ``ready`` is the piece: :data:`STREAM_COPIES`
    pieces; a quantised piece is decoded on the device into more bytes than it crosses in, with temporaries."""
    return (STREAM_COPIES - 1) * piece + ready


@dataclass(frozen=True)
class Option:
    """How one layer streams under a unit: the bytes of its largest piece, its slices if it is sliced, and the
    bytes that piece takes on the device once made ready to compute (``ready``)."""

    piece: int
    slices: RowSlices | None
    ready: int


Multiples = Mapping[str, int | None] | None


def options_of(streamable: Sequence[Layer], unit: int, multiples: Multiples) -> dict[int, Option]:
    """How each streamable layer would stream (by ``id``): in slices when it is larger than ``unit`` and its
    rows can be sliced on the multiple its owner allows (``multiples``; :data:`ROW_QUANTUM` by default)."""
    options = {}
    for layer in streamable:
        multiple = ROW_QUANTUM if multiples is None else multiples.get(layer.name, ROW_QUANTUM)
        extra = layer.nbytes - layer.rows * layer.row_bytes  # the bias: it crosses whole, with the first slice
        slices = None
        if layer.rows and multiple is not None and layer.nbytes > unit:
            slices = row_slices(layer.rows, layer.row_bytes, unit, multiple, extra)
        piece = layer.nbytes if slices is None else slices.largest * layer.row_bytes + extra
        rows = None if slices is None else slices.largest
        ready = ready_bytes(layer.module, piece, rows)
        options[id(layer)] = Option(carried(layer, slices), slices, ready)
    return options


def carried(layer: Layer, slices: RowSlices | None) -> int:
    """The device bytes the largest piece of ``layer`` takes in a ring slot: a ring's slot mirrors its host slab,
    where every tensor starts on a page of its own (``core.placement.slabs``), so on a host of 64 KiB pages a
    256-byte bias takes 64 KiB there. A layer no ring carries (a cast of its own) copies its tensors as they are."""
    extra = layer.nbytes - layer.rows * layer.row_bytes  # the bias
    rows = layer.rows if slices is None else slices.largest
    if not groupable(layer.module):
        return rows * layer.row_bytes + extra if layer.rows else layer.nbytes
    if slices is None:
        return layer_bytes(layer.module)
    return aligned(rows * layer.row_bytes) + (aligned(extra) if extra else 0)


def largest(ways: Sequence[Option | None]) -> Option | None:
    """The largest piece and the largest readied piece of ``ways`` (``None`` ones left out; ``None`` if no other)."""
    ways = [way for way in ways if way is not None]
    return Option(max(w.piece for w in ways), None, max(w.ready for w in ways)) if ways else None


def room_for(ways: Sequence[Option | None]) -> tuple[int, int]:
    """The streaming reserve for streaming ``ways``, and its part for one piece made ready to compute."""
    most = largest(ways)
    return (0, 0) if most is None else (stream_reserve(most.piece, most.ready), most.ready)


def widened(options: Mapping[int, Option], streamed: Sequence[Layer], multiples: Multiples) -> Mapping[int, Option]:
    """``options`` with the ``streamed`` layers sliced with their largest piece as the unit: no slice finer than
    the reserve needs. Kept as they are where the wider pieces would need a larger reserve (a quantised piece made
    ready takes more than it crosses in, so a larger one of it may outgrow the readied piece that set the reserve)."""
    if not streamed:
        return options
    before = room_for([options[id(layer)] for layer in streamed])
    wider = options_of(streamed, largest([options[id(layer)] for layer in streamed]).piece, multiples)
    if room_for(list(wider.values())) != before:
        return options
    return {**options, **wider}
