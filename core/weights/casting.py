"""A cast layer's weight and bias made ready for one computation: whole, or one row slice at a time.

The cast follows ComfyUI's order, so results are bit-identical to ``comfy.ops.manual_cast``: the weight moves
to the compute device in its stored dtype (fewer bytes over the bus), then converts; the bias moves and
converts in one step; the owner's functions (on-the-fly patches) run last, on a private copy. A layer its model
streams takes its weight and bias from the model's ring (``core.placement.ring``): views of a slot its group was
copied into, ahead of use; a layer the ring cannot serve copies its own tensors.

**Row slices.** A layer the placement engine streams in slices (``core.devices.slices``) computes its output
rows slice by slice (:func:`forward_in_slices`): its bias crosses with the first slice (and is kept, a private copy,
while the others compute), then each slice of its weight, a group of the ring of its own, is cast and patched just
before the rows it computes, and released before the next one is used. A patch function
takes part in a slice through two methods, ``slice_multiple(shape)`` (the row multiple its slices must start on,
or ``None`` when it needs the whole weight) and ``rows(weight, start, stop)`` (the patched slice, equal to
the same rows of the whole patched weight). A layer with a function that cannot computes whole, as before.

**Quantised weights** (``core.weights.quantized``) cross as their stored bytes and are dequantised where the
stored dtype would be converted, whole or one row slice at a time, before any patch function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..devices.backends import backend_of, target_of
from ..devices.slices import SLICES, RowSlices
from ..devices.tensors import Target
from ..devices.transfer import GROUPED, to_target
from .quantized import QUANTIZED, QuantizedLayout, layout_of, weight_shape

#: ``compute(input, weight, bias)`` of one layer (``F.linear``, a convolution) on a weight and bias ready to use.
Compute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def cast_weight_bias(
    layer: torch.nn.Module,
    input: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    target: Target | None = None,
    bias_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``layer``'s weight and bias, ready to compute with ``input`` (on its device, in its dtype)."""
    if input is not None:
        dtype = dtype or input.dtype
        bias_dtype = bias_dtype or dtype
        target = target if target is not None else target_of(input)
    grouped = layer.__dict__.get(GROUPED) if target is not None else None
    views = grouped.fetch(target) if grouped is not None else None  # streamed through its model's ring
    if views is not None:
        return _ready(layer, views, dtype, bias_dtype)
    return _copied(layer, target, dtype, bias_dtype)


def _copied(
    layer: torch.nn.Module, target: Target | None, dtype: torch.dtype | None, bias_dtype: torch.dtype | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``layer``'s weight and bias copied to ``target`` one by one (where they are not there already)."""
    bias = None
    if getattr(layer, "bias", None) is not None:
        bias_functions = getattr(layer, "bias_function", ())
        bias = cast_one(layer.bias, target, bias_dtype, bias_functions, always=True, layout=layout_of(layer, "bias"))
    weight_functions = getattr(layer, "weight_function", ())
    weight = cast_one(layer.weight, target, dtype, weight_functions, always=False, layout=layout_of(layer, "weight"))
    return weight, bias


def _ready(
    layer: torch.nn.Module,
    views: tuple[torch.Tensor | None, torch.Tensor | None],
    dtype: torch.dtype | None,
    bias_dtype: torch.dtype | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A ring's views of ``layer``'s weight and bias made ready as :func:`cast_one` makes copies: the bias always
    in its dtype, the weight cast only when needed; a private copy where patch functions apply (the slot is
    shared with the next groups)."""
    weight, bias = views
    layouts = layer.__dict__.get(QUANTIZED) or {}  # looked up here: this runs for every streamed layer call
    if bias is not None:
        bias = _finish(bias, bias_dtype, getattr(layer, "bias_function", ()), always=True, layout=layouts.get("bias"))
    if weight is not None:
        functions = getattr(layer, "weight_function", ())
        weight = _finish(weight, dtype, functions, always=False, layout=layouts.get("weight"))
    return weight, bias


def _finish(
    view: torch.Tensor,
    dtype: torch.dtype | None,
    functions: Sequence,
    *,
    always: bool,
    layout: QuantizedLayout | None = None,
    rows: tuple[int, int] | None = None,
) -> torch.Tensor:
    if layout is not None:  # decoding makes a private tensor: the slot stays as it is
        return _patched(layout.decode(view, dtype, rows), functions)
    if functions:
        result = view.to(dtype=dtype or view.dtype, copy=True)
        for function in functions:
            result = function(result)
        return result
    if dtype is not None and (always or view.dtype != dtype):
        return view.to(dtype=dtype)
    return view


def cast_one(
    tensor: torch.Tensor,
    target: Target | None,
    dtype: torch.dtype | None,
    functions: Sequence,
    *,
    always: bool,
    rows: tuple[int, int] | None = None,
    layout: QuantizedLayout | None = None,
) -> torch.Tensor:
    """``tensor`` (its ``rows`` only, when given) on ``target`` in ``dtype`` with the owner's patch ``functions``
    applied (a copy when there are any, so the stored tensor is never changed). The weight is cast only when its
    dtype differs or functions apply; the bias is always brought to its dtype (ComfyUI's order of operations, for
    identical results). Quantised bytes (``layout``) are dequantised on ``target`` (already a new tensor: no private
    copy is made first)."""
    source = tensor if rows is None else tensor.narrow(0, rows[0], rows[1] - rows[0])
    result = to_target(source, target, copy=bool(functions) and layout is None)
    if layout is not None:
        return _patched(layout.decode(result, dtype, rows), functions)
    if always:
        result = result.to(dtype=dtype) if dtype is not None else result
    elif functions or (dtype is not None and result.dtype != dtype):
        result = result.to(dtype=dtype)
    return _patched(result, functions)


def _patched(weight: torch.Tensor, functions: Sequence) -> torch.Tensor:
    """``weight`` (a private tensor) with the owner's patch ``functions`` applied, in order."""
    for function in functions:
        weight = function(weight)
    return weight


def _take_slices(functions: Sequence, shape: tuple[int, ...], slices: RowSlices) -> bool:
    """Whether every weight function applies to these slices of a weight of ``shape`` alone."""
    for function in functions:
        slice_multiple = getattr(function, "slice_multiple", None)
        multiple = slice_multiple(shape) if slice_multiple is not None else None
        if multiple is None or not slices.aligned_to(multiple):
            return False
    return True


def forward_in_slices(layer: torch.nn.Module, input: torch.Tensor, compute: Compute, dim: int) -> torch.Tensor | None:
    """``layer``'s output computed one row slice of its weight at a time (``dim``: the output's dimension of the
    weight's rows); ``None`` when the layer does not stream in slices now, computes where its weight is, or has a
    weight function that needs the whole weight (the caller then computes it whole)."""
    slices: RowSlices | None = layer.__dict__.get(SLICES)
    if slices is None:
        return None
    weight, functions = layer.weight, getattr(layer, "weight_function", ())
    dtype, target = input.dtype, target_of(input)
    shape, layout = weight_shape(layer), layout_of(layer, "weight")
    if backend_of(target).holds(weight, target) or not _take_slices(functions, shape, slices):
        return None  # computing where the weight is (the host, for a host input): nothing crosses
    grouped = layer.__dict__.get(GROUPED)
    out, bias = None, None
    for index, (start, stop) in enumerate(slices.ranges()):
        views = grouped.fetch(target, index) if grouped is not None else None
        if not index:
            bias = _slice_bias(layer, views, target, dtype)
        part_weight = _slice_weight(weight, views, target, dtype, functions, layout, (start, stop))
        part = compute(input, part_weight, None if bias is None else bias[start:stop])
        del part_weight  # released before the next slice is used
        out = _output_for(part, dim, shape[0]) if out is None else out
        out.narrow(dim, start, stop - start).copy_(part)
    return out


def _slice_weight(
    weight: torch.Tensor,
    views: tuple[torch.Tensor | None, torch.Tensor | None] | None,
    target: Target,
    dtype: torch.dtype,
    functions: Sequence,
    layout: QuantizedLayout | None,
    rows: tuple[int, int],
) -> torch.Tensor:
    """Rows ``rows`` of ``weight`` ready to compute, ``functions`` (the weight's) applied to those rows: the ring's
    view of them made ready, or (where the ring cannot serve the layer) copied here."""
    on_rows = [_on_rows(function, *rows) for function in functions] if functions else ()
    if views is None:
        return cast_one(weight, target, dtype, on_rows, always=False, rows=rows, layout=layout)
    return _finish(views[0], dtype, on_rows, always=False, layout=layout, rows=rows)


def _output_for(part: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    """The whole output of a layer computing in slices, shaped from its first slice's part."""
    size = list(part.shape)
    size[dim] = rows
    return part.new_empty(size)


def _slice_bias(
    layer: torch.nn.Module,
    views: tuple[torch.Tensor | None, torch.Tensor | None] | None,
    target: Target,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """The bias of a layer computing in slices, ready for every slice: from the ring's first slice (a private copy:
    the slot is refilled while the later slices compute), or copied here."""
    if getattr(layer, "bias", None) is None:
        return None
    functions, layout = getattr(layer, "bias_function", ()), layout_of(layer, "bias")
    if views is None:
        return cast_one(layer.bias, target, dtype, functions, always=True, layout=layout)
    bias = _finish(views[1], dtype, functions, always=True, layout=layout)
    return bias.clone() if bias.data_ptr() == views[1].data_ptr() else bias


def _on_rows(function: Callable, start: int, stop: int) -> Callable:
    """``function`` applied to rows ``start:stop`` of its weight."""
    return lambda weight: function.rows(weight, start, stop)
