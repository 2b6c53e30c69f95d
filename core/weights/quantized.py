"""Weights kept in GGML's quantised blocks (a GGUF model's), dequantised by the cast, where they compute.

A quantised weight is an ordinary ``uint8`` parameter holding the file's bytes, shaped ``(rows, bytes per row)``
for a weight of two or more dimensions: GGML quantises along the innermost dimension, so each output row is a run
of whole blocks, and rows ``a:b`` of the bytes are the blocks of rows ``a:b`` of the weight. So the placement engine
moves, books and budgets it like any other tensor, in quantised bytes, and streams it whole or in row slices
unchanged. Its layer carries the GGML type and the weight's shape (:func:`layout_of`); the cast path
(``core.weights.casting``) decodes the bytes where it would convert a stored dtype: after the copy to the compute
device (quantised bytes cross the link, not fp16), before any patch function, so a LoRA applies to the
dequantised weight with the same math as on any other weight. A quantised layer always computes through the cast
(``core.weights.ops``): its stored bytes cannot be multiplied as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..devices.reported import shaped_parameter
from ..devices.slices import READY_BYTES
from .ggml_blocks import BlockLayout, check_bytes, decode_bytes, dequantize

#: A layer's ``__dict__`` key: parameter name -> :class:`QuantizedLayout` of its quantised parameters.
QUANTIZED = "device_control_quantized"

#: The dtypes a quantised weight may be decoded into: its layer computes in its input's dtype, which is not known
#: when the placement plan keeps room for the decode, so the plan keeps room for the largest of these.
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class QuantizedLayout:
    """How a quantised parameter's bytes read: its GGML type and the shape of the weight they hold."""

    kind: BlockLayout
    shape: tuple[int, ...]

    def decode(self, raw: torch.Tensor, dtype: torch.dtype | None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The weight (its ``rows`` only, when ``raw`` holds just those) in ``dtype`` (float32 when ``None``),
        dequantised on ``raw``'s device."""
        shape = self.shape if rows is None else (rows[1] - rows[0], *self.shape[1:])
        values = dequantize(raw.reshape(-1), self.kind, self.blocks_shape(rows), dtype or torch.float32)
        return values.reshape(shape)

    def decode_bytes(self, dtype: torch.dtype, rows: tuple[int, int] | None = None) -> int:
        """The most device bytes :meth:`decode` holds at once into ``dtype`` (its result and its temporaries),
        for the whole weight or its ``rows``."""
        count = 1
        for dim in self.blocks_shape(rows):
            count *= dim
        return decode_bytes(self.kind, count, dtype)

    def row_shape(self) -> tuple[int, ...]:
        """The stored bytes' shape: one row of blocks per output row where each row is whole blocks; flat
        otherwise (a one-dimensional weight; a weight whose file rows were not its rows: it streams whole)."""
        return self.blocks_shape(nbytes=True)

    def blocks_shape(self, rows: tuple[int, int] | None = None, *, nbytes: bool = False) -> tuple[int, ...]:
        """The shape the blocks of the weight (its ``rows``) decode in, or with ``nbytes`` their bytes' shape:
        rows of whole blocks when the weight's rows are whole blocks, else one run of values."""
        count = rows[1] - rows[0] if rows is not None else (self.shape[0] if self.shape else 1)
        row = 1
        for dim in self.shape[1:]:
            row *= dim
        if len(self.shape) >= 2 and row % self.kind.values == 0:
            return (count, self.kind.nbytes(row) if nbytes else row)
        total = count * row if len(self.shape) >= 2 else count
        return (self.kind.nbytes(total) if nbytes else total,)


def quantize_parameter(
    layer: torch.nn.Module, name: str, raw: torch.Tensor, kind: BlockLayout, shape: Sequence[int]
) -> None:
    """Make ``layer``'s parameter ``name`` hold the quantised bytes ``raw`` (a ``uint8`` tensor of the weight's
    blocks, as the file stores them) of a ``kind`` weight of ``shape``; the layer computes through the cast from
    now on.

    Raises:
        ModelFileError: ``raw`` is not the bytes of ``shape`` in ``kind`` (checked before anything changes).
    """
    layout = QuantizedLayout(kind, tuple(int(dim) for dim in shape))
    check_bytes(raw, kind, layout.blocks_shape())
    set_quantized(layer, name, quantized_parameter(raw, layout), layout)


def quantized_parameter(blocks: torch.Tensor, layout: QuantizedLayout) -> torch.nn.Parameter:
    """A parameter of the bytes ``blocks`` (on any device) shaped as ``layout`` stores them, reporting the weight's
    shape (``core.devices.reported``): code that reads a layer's weight shape sees the weight's."""
    return shaped_parameter(blocks.reshape(layout.row_shape()), layout.shape)


def set_quantized(layer: torch.nn.Module, name: str, parameter: torch.nn.Parameter, layout: QuantizedLayout) -> None:
    """Make ``parameter`` (from :func:`quantized_parameter`) ``layer``'s parameter ``name``, read as ``layout``
    says. A loader that checked the bytes' size itself calls this directly."""
    layer._parameters[name] = parameter
    layer.__dict__.setdefault(QUANTIZED, {})[name] = layout
    layer.__dict__[READY_BYTES] = decoded_bytes


def layout_of(layer: torch.nn.Module, name: str) -> QuantizedLayout | None:
    """The layout of ``layer``'s quantised parameter ``name``; ``None`` when it holds plain values."""
    layouts = layer.__dict__.get(QUANTIZED)
    return layouts.get(name) if layouts else None


def decoded_bytes(layer: torch.nn.Module, nbytes: int, rows: int | None = None) -> int:
    """The device bytes a streamed piece of ``layer`` (``nbytes`` of its stored bytes: the whole layer, or the first
    ``rows`` of its weight and its other tensors) takes once made ready to compute: each quantised tensor of it
    decoded (:meth:`QuantizedLayout.decode_bytes`: its result and temporaries, in the largest of
    :data:`COMPUTE_DTYPES`), its other tensors counted at their stored size. A quantised layer keeps this function
    under ``core.devices.slices.READY_BYTES``, where the placement plan reads it."""
    ready = nbytes
    for name, layout in (layer.__dict__.get(QUANTIZED) or {}).items():
        part = (0, rows) if rows is not None and name == "weight" else None
        count = 1
        for dim in layout.blocks_shape(part):
            count *= dim
        ready += max(layout.decode_bytes(dtype, part) for dtype in COMPUTE_DTYPES) - layout.kind.nbytes(count)
    return ready


def is_quantized(layer: torch.nn.Module) -> bool:
    """Whether any of ``layer``'s parameters holds quantised bytes (it must then compute through the cast)."""
    return bool(layer.__dict__.get(QUANTIZED))


def weight_shape(layer: torch.nn.Module) -> tuple[int, ...]:
    """The shape of ``layer``'s weight as it computes (what a quantised weight reports, not its bytes')."""
    return tuple(layer.weight.shape)
