"""Moving weights to the compute device for one use.

Streamed weights cross in groups through their model's ring (``core.placement.ring``): one copy per group on the
device's side stream, ordered by events, from page-locked slabs. What is left here is the copy a layer makes of its
own tensors when no ring serves it (a layer with a cast of its own, a ring with no room, another device): made on
the current stream, so it is in order with the computation that uses it and its memory lives exactly as long as
the tensor (no cross-stream bookkeeping), without the host waiting where the source is pinned or on a device.
Host memory is page-locked through ``core.devices.pinned`` (one cap, one set of books); where it is not, the copy
is simply blocking. The same code runs on every backend (``core.devices.backends``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from .backends import Target, backend_of, target_of
from .tensors import HOST, count_copy, same_target, tensor_bytes

#: True on a layer class whose cast copies its weights through the device's backend (:func:`to_target`), so they
#: may live on any device: a ring carries its weights, and a split model's donor streams only such layers
#: (``core.placement.donors``).
CASTS_ANYWHERE = "device_control_casts_anywhere"

#: The attribute a layer streamed through its model's ring carries (``core.placement.ring``): a
#: :class:`GroupedLayer`; the cast layers ask it for their weight and bias on the device.
GROUPED = "device_control_grouped"


class GroupedLayer(Protocol):
    """What a cast layer asks of its model's ring."""

    def fetch(self, target: Target, index: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """The layer's weight and bias on ``target`` (views of a ring slot, their copy waited for by the compute
        stream), or for a layer streamed in row slices slice ``index`` of its weight (with its bias for the first);
        ``None`` when the ring cannot serve it."""


def to_target(tensor: torch.Tensor, target: Target, *, copy: bool = False) -> torch.Tensor:
    """``tensor`` on ``target`` for one computation (copied only when it is elsewhere, or when ``copy``: the result
    will be changed in place, by a patch).

    The copy runs on the current stream, in order with the computation; the host does not wait for it where the
    source is pinned host memory or another device's memory (a split model's donor GPU).
    """
    backend = backend_of(target)
    if backend.holds(tensor, target):
        return tensor.clone() if copy else tensor
    source = target_of(tensor)
    count_copy(source, target, tensor_bytes(tensor))
    non_blocking = not same_target(source, HOST) or backend.is_pinned(tensor)
    return backend.copy_to(tensor, target, non_blocking=non_blocking, copy=copy)
