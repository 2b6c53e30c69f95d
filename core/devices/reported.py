"""The shape a tensor reports when its storage holds something else.

A quantised weight (``core.weights.quantized``) stores its GGML blocks as ``uint8`` rows, but code outside the
engine reads a layer's weight shape (ComfyUI's Flux counts its input channels from ``img_in.weight.shape``, Wan
from ``patch_embedding.weight.shape``; other packs do the same), so the weight reports its weight's shape, kept in
its ``__dict__`` under :data:`REPORTED_SHAPE`, while its storage's sizes (``size()``, ``numel()``,
``element_size()``) stay the bytes'. The engine and every backend read ``size()``, never ``shape``, of a tensor
they move; a backend that changes a tensor's class while it holds it reports the same shape.
"""

from __future__ import annotations

import torch

#: A tensor's ``__dict__`` key: the shape it reports instead of its storage's.
REPORTED_SHAPE = "device_control_shape"


def reported_shape(tensor: torch.Tensor) -> torch.Size:
    """The shape ``tensor`` reports: its own, or the one set under :data:`REPORTED_SHAPE`."""
    reported = tensor.__dict__.get(REPORTED_SHAPE)
    return reported if reported is not None else tensor.size()


class ShapedParameter(torch.nn.Parameter):
    """A parameter that reports the shape under :data:`REPORTED_SHAPE` instead of its storage's."""

    @property
    def shape(self) -> torch.Size:
        return reported_shape(self)

    def __deepcopy__(self, memo: dict) -> ShapedParameter:
        copied = super().__deepcopy__(memo)
        copied.__dict__[REPORTED_SHAPE] = self.__dict__.get(REPORTED_SHAPE)
        return copied


def shaped_parameter(data: torch.Tensor, shape: tuple[int, ...]) -> torch.nn.Parameter:
    """A parameter (no gradient) of ``data`` that reports ``shape``."""
    parameter = ShapedParameter(data, requires_grad=False)
    parameter.__dict__[REPORTED_SHAPE] = torch.Size(shape)
    return parameter


def plain_class(tensor: torch.Tensor) -> type:
    """The class of a tensor with the flags a device kept on it (``_is_param``, :data:`REPORTED_SHAPE`), once the
    device gives it back as a host tensor."""
    if not getattr(tensor, "_is_param", False):
        return torch.Tensor
    return ShapedParameter if tensor.__dict__.get(REPORTED_SHAPE) is not None else torch.nn.Parameter
