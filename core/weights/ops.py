"""Layers that compute with weights stored elsewhere: on another device, in another dtype, patched on the fly.

They speak the protocol of ComfyUI's own layers, so ComfyUI's model patcher drives them unchanged:

* ``comfy_cast_weights``: when true, every forward casts the weight and bias to the input's device and dtype
  first (they may live in host memory, or in fp16/bf16/fp8 while the computation runs in fp32);
* ``weight_function`` / ``bias_function``: callables applied to the cast weight and bias, in order (how a LoRA
  is applied to a layer that is not resident).

A layer whose weight is quantised (``core.weights.quantized``, a GGUF model's) always computes through the cast.

How the weights are made ready (and in which order, for results bit-identical to ``comfy.ops.manual_cast``)
is ``core.weights.casting``; a Linear or convolution streamed in row slices computes its output slice by slice
there. A per-tensor ``scale_weight`` (scaled fp8) is applied like ComfyUI's scaled-fp8 layers do.

:func:`convert` turns an existing module tree's layers into cast layers in place and returns a handle whose
``undo`` restores them; the forward signatures do not change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F  # noqa: N812 - the name every torch user knows

from ..devices.backends import target_of
from ..devices.slices import SLICES
from ..devices.transfer import CASTS_ANYWHERE
from ..progress import ProgressCallback
from .casting import cast_weight_bias, forward_in_slices
from .quantized import QUANTIZED


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float | None) -> torch.Tensor:
    shape = tuple(weight.shape) if weight is not None else (x.shape[-1],)
    return F.rms_norm(x, shape, weight.to(dtype=x.dtype) if weight is not None else None, eps)


def _casting(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` computes through the cast: told to, patched on the fly, or quantised (its bytes must be
    dequantised wherever they are)."""
    # Asked at every forward of every layer: plain lookups, no call (``is_quantized`` is this last one).
    flags = layer.comfy_cast_weights or layer.weight_function or layer.bias_function
    return bool(flags or layer.__dict__.get(QUANTIZED))


class CastLayer:
    """Mixin giving a torch layer the cast-on-the-fly protocol (added in front of the layer's own class)."""

    comfy_cast_weights = False
    weight_function: list = []  # noqa: RUF012 - class-level defaults, as ComfyUI's layers have; set per instance
    bias_function: list = []  # noqa: RUF012


setattr(CastLayer, CASTS_ANYWHERE, True)  # its cast goes through to_target (core.weights.casting)


class Linear(CastLayer, torch.nn.Linear):
    """``nn.Linear`` that casts its weights on the fly (and applies a scaled-fp8 scale when it has one); streamed in
    row slices, it computes its output features slice by slice."""

    device_control_sliceable = True  # core.devices.slices.SLICEABLE

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not _casting(self):
            return super().forward(input)
        if SLICES in self.__dict__:  # streamed in row slices (asked inline: every streamed layer call passes here)
            out = forward_in_slices(self, input, self._linear, -1)
            if out is not None:
                return out
        weight, bias = cast_weight_bias(self, input)
        return self._linear(input, weight, bias)

    def _linear(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        scale = getattr(self, "scale_weight", None)
        if scale is None:
            return F.linear(input, weight, bias)
        scale = scale.to(device=weight.device, dtype=weight.dtype)
        if self.weight.numel() < input.numel():  # scale whichever operand is smaller (the whole weight decides)
            return F.linear(input, weight * scale, bias)
        return F.linear(input * scale, weight, bias)


class _Conv(CastLayer):
    @property
    def device_control_sliceable(self) -> bool:  # core.devices.slices.SLICEABLE: output channels, one group
        return self.groups == 1

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not _casting(self):
            return super().forward(input)
        if SLICES in self.__dict__:  # streamed in row slices (asked inline: every streamed layer call passes here)
            out = forward_in_slices(self, input, self._conv_forward, 1)
            if out is not None:
                return out
        weight, bias = cast_weight_bias(self, input)
        return self._conv_forward(input, weight, bias)


class Conv1d(_Conv, torch.nn.Conv1d):
    """``nn.Conv1d`` with cast-on-the-fly weights."""


class Conv2d(_Conv, torch.nn.Conv2d):
    """``nn.Conv2d`` with cast-on-the-fly weights."""


class Conv3d(_Conv, torch.nn.Conv3d):
    """``nn.Conv3d`` with cast-on-the-fly weights."""


class _ConvTranspose(CastLayer):
    _dims = 2

    def forward(self, input: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        if not _casting(self):
            return super().forward(input, output_size)
        padding = self._output_padding(
            input, output_size, self.stride, self.padding, self.kernel_size, self._dims, self.dilation
        )
        weight, bias = cast_weight_bias(self, input)
        function = F.conv_transpose1d if self._dims == 1 else F.conv_transpose2d
        return function(input, weight, bias, self.stride, self.padding, padding, self.groups, self.dilation)


class ConvTranspose1d(_ConvTranspose, torch.nn.ConvTranspose1d):
    """``nn.ConvTranspose1d`` with cast-on-the-fly weights."""

    _dims = 1


class ConvTranspose2d(_ConvTranspose, torch.nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` with cast-on-the-fly weights."""


class GroupNorm(CastLayer, torch.nn.GroupNorm):
    """``nn.GroupNorm`` with cast-on-the-fly affine parameters."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not _casting(self):
            return super().forward(input)
        weight, bias = cast_weight_bias(self, input)
        return F.group_norm(input, self.num_groups, weight, bias, self.eps)


class LayerNorm(CastLayer, torch.nn.LayerNorm):
    """``nn.LayerNorm`` with cast-on-the-fly affine parameters."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not _casting(self):
            return super().forward(input)
        weight, bias = cast_weight_bias(self, input) if self.weight is not None else (None, None)
        return F.layer_norm(input, self.normalized_shape, weight, bias, self.eps)


class RMSNorm(CastLayer, torch.nn.RMSNorm):
    """``nn.RMSNorm`` with a cast-on-the-fly scale."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _casting(self):
            return super().forward(x)
        weight, _ = cast_weight_bias(self, x) if self.weight is not None else (None, None)
        return _rms_norm(x, weight, self.eps)


class Embedding(CastLayer, torch.nn.Embedding):
    """``nn.Embedding`` with a cast-on-the-fly table; ``out_dtype`` picks the output dtype (as in ComfyUI)."""

    def forward(self, input: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if not _casting(self):
            return super().forward(input)
        # A half-precision table is looked up as stored; only the rows taken are converted afterwards.
        table_dtype = None if self.weight.dtype in (torch.float16, torch.bfloat16) else out_dtype
        weight, _ = cast_weight_bias(self, dtype=table_dtype, target=target_of(input))
        out = F.embedding(
            input, weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse
        )
        return out.to(dtype=out_dtype)


#: torch layer type -> our cast layer of that type.
CAST_LAYERS: dict[type, type] = {
    torch.nn.Linear: Linear,
    torch.nn.Conv1d: Conv1d,
    torch.nn.Conv2d: Conv2d,
    torch.nn.Conv3d: Conv3d,
    torch.nn.ConvTranspose1d: ConvTranspose1d,
    torch.nn.ConvTranspose2d: ConvTranspose2d,
    torch.nn.GroupNorm: GroupNorm,
    torch.nn.LayerNorm: LayerNorm,
    torch.nn.RMSNorm: RMSNorm,
    torch.nn.Embedding: Embedding,
}


def without_init(layer_type: type) -> type:
    """``layer_type`` whose constructor skips weight initialisation (for layers filled from a file next)."""
    return type(
        layer_type.__name__, (layer_type,), {"reset_parameters": lambda self: None, "__module__": layer_type.__module__}
    )


_mixed: dict[tuple[type, type], type] = {}


def _cast_class(original: type) -> type | None:
    """The class a layer of class ``original`` becomes: our cast layer mixed in front of ``original``."""
    base = next((torch_type for torch_type in CAST_LAYERS if issubclass(original, torch_type)), None)
    if base is None or issubclass(original, CastLayer):  # not a layer we know, or already a cast layer
        return None
    key = (original, base)
    if key not in _mixed:  # one class per original class, so isinstance and pickling stay sane
        _mixed[key] = type(original.__name__, (CAST_LAYERS[base], original), {"__module__": original.__module__})
    return _mixed[key]


def can_cast(cls: type) -> bool:
    """Whether a layer of class ``cls`` is, or :func:`convert` makes it, a cast layer."""
    return issubclass(cls, CastLayer) or _cast_class(cls) is not None


_MISSING = object()


@dataclass
class ConvertedTree:
    """What :func:`convert` changed, so :meth:`undo` can put every layer back as it was."""

    layers: list[tuple[torch.nn.Module, type, object]] = field(default_factory=list)

    def undo(self) -> None:
        """Restore every converted layer's class and ``comfy_cast_weights`` (weights are untouched)."""
        for layer, original, own_flag in reversed(self.layers):
            layer.__class__ = original
            if own_flag is _MISSING:
                layer.__dict__.pop("comfy_cast_weights", None)
            else:
                layer.comfy_cast_weights = own_flag
        self.layers.clear()


def convert(
    module: torch.nn.Module,
    *,
    cast: bool | None = None,
    accept: Callable[[type], bool] = lambda _cls: True,
    progress: ProgressCallback | None = None,
) -> ConvertedTree:
    """Turn every supported layer of ``module`` into a cast layer, in place.

    Args:
        module: the tree to convert.
        cast: set ``comfy_cast_weights`` on every converted layer to this (``None`` keeps each layer's own).
        accept: says which layer classes to convert (a host application may leave its special layers alone).
        progress: called with (layers done, layers total); may raise to stop (what is done so far is undone).
    """
    candidates = [(m, _cast_class(type(m))) for m in module.modules() if accept(type(m))]
    candidates = [(m, cls) for m, cls in candidates if cls is not None]
    handle = ConvertedTree()
    try:
        for done, (layer, cls) in enumerate(candidates, 1):
            flag = getattr(layer, "comfy_cast_weights", False)  # the layer's own class may say True
            handle.layers.append((layer, type(layer), layer.__dict__.get("comfy_cast_weights", _MISSING)))
            layer.__class__ = cls
            layer.comfy_cast_weights = flag if cast is None else cast
            if progress is not None:
                progress(done, len(candidates))
    except BaseException:
        handle.undo()
        raise
    return handle


def set_cast_flags(module: torch.nn.Module, stored: torch.dtype, compute: torch.dtype | None) -> None:
    """Set ``comfy_cast_weights`` on ``module``'s layers for a model stored in ``stored`` that computes in
    ``compute`` (``None``: in ``stored`` itself), as the host application builds a model for one device.

    With a compute dtype of its own every layer casts (ComfyUI's manual cast). Without, a layer whose parameters
    are all in ``stored`` casts no more: left set from an earlier device (a load to the CPU casts float16 to
    float32), its resident weights would go through the cast path at every forward for nothing. A layer with
    parameters in another dtype keeps its flag. A streaming layer (``prev_comfy_cast_weights``, ComfyUI's mark)
    keeps casting: the flag it gets back when it becomes resident is set instead.
    """
    for layer in module.modules():
        if not hasattr(layer, "comfy_cast_weights"):
            continue
        if compute is None and any(
            p.is_floating_point() and p.dtype != stored for p in layer.parameters(recurse=False)
        ):
            continue
        name = "prev_comfy_cast_weights" if hasattr(layer, "prev_comfy_cast_weights") else "comfy_cast_weights"
        setattr(layer, name, compute is not None)
