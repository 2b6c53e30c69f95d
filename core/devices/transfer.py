"""Moving weights to the compute device for one use, and pinned host memory.

Streamed weights cross in groups through their model's ring (``core.placement.ring``): one copy per group on the
device's side stream, ordered by events, from page-locked slabs. What is left here is the copy a layer makes of its
own tensors when no ring serves it (a layer with a cast of its own, a ring with no room, another device): made on
the current stream, so it is in order with the computation that uses it and its memory lives exactly as long as
the tensor (no cross-stream bookkeeping), without the host waiting where the source is pinned or on a device.
Host memory is pinned in place, up to a cap (a fraction of RAM, default 45 %,
``DEVICE_CONTROL_MAX_PINNED_FRACTION`` to change it); when pinning fails or the cap is reached the copy is simply
blocking. The same code runs on every backend (``core.devices.backends``).
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from collections.abc import Mapping
from typing import Protocol

import psutil
import torch

from ..errors import InvalidSizeError
from .backends import Target, backend_of, label_of, target_of
from .tensors import HOST, count_copy, same_target, tensor_bytes

log = logging.getLogger("device_control")


def compute_target(tensor: torch.Tensor) -> Target:
    """Where a computation on ``tensor`` happens."""
    return target_of(tensor)


def side_stream(target: Target) -> object | None:
    """The copy stream of ``target`` (created once), or ``None`` where the backend has no streams."""
    return backend_of(target).side_stream(target)


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


PINNED_FRACTION_ENV = "DEVICE_CONTROL_MAX_PINNED_FRACTION"
DEFAULT_PINNED_FRACTION = 0.45
_pinned_fraction = DEFAULT_PINNED_FRACTION


def pinned_fraction_from_env(environ: Mapping[str, str] | None = None) -> float:
    """The share of physical RAM that may be pinned, from ``DEVICE_CONTROL_MAX_PINNED_FRACTION`` (default 0.45).

    Raises:
        InvalidSizeError: the value is not a number from 0 to 1 (the message shows how to write it).
    """
    text = (os.environ if environ is None else environ).get(PINNED_FRACTION_ENV, "").strip()
    if not text:
        return DEFAULT_PINNED_FRACTION
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:  # NaN fails too
        raise InvalidSizeError(
            f"{PINNED_FRACTION_ENV}={text!r} is not a share of RAM from 0 to 1; write it like "
            f"{PINNED_FRACTION_ENV}=0.45 (0 turns pinning off)."
        )
    return value


def use_pinned_fraction(fraction: float) -> None:
    """Cap pinned host memory at ``fraction`` of physical RAM from now on (the settings do this at start)."""
    global _pinned_fraction, _pinned
    _pinned_fraction = fraction
    if _pinned is not None and not _pinned.pinned_bytes:  # nothing pinned yet: the next account uses the new cap
        _pinned = None


class PinnedMemory:
    """Pins host tensors in place (page-locked, for fast non-blocking copies) up to a byte cap.

    Args:
        max_bytes: the cap; default the configured share of physical RAM (:func:`use_pinned_fraction`).
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        if max_bytes is None:
            max_bytes = int(psutil.virtual_memory().total * _pinned_fraction)
        self.max_bytes = max_bytes
        self.pinned: dict[int, tuple[int, Target]] = {}  # data pointer -> (bytes, the device it was pinned for)
        self.failed: set[str] = set()  # labels of devices whose pinning failed since the last retry
        self.blocks: dict[int, tuple[int, Target, weakref.finalize]] = {}  # blocks locked: see :meth:`lock`

    @property
    def pinned_bytes(self) -> int:
        """Bytes pinned now: tensors pinned in place, and blocks locked (:meth:`lock`)."""
        return sum(size for size, _target in self.pinned.values()) + sum(size for size, *_rest in self.blocks.values())

    def lock(self, block: torch.Tensor, target: Target, *, capped: bool = True) -> bool:
        """Page-lock ``block`` (one host tensor, a ring's slab) in place for copies to ``target``, at its exact size,
        counted against the cap until :meth:`unlock` or until the block's tensor is freed; ``False`` where the
        backend cannot, the cap is reached, or locking failed (the block stays pageable: copies stay correct, and
        block the host). ``capped=False``: locked even past the cap (a ring's small staging buffers, what lets
        the groups the cap left pageable cross without stopping the host); counted all the same."""
        label, backend = label_of(target), backend_of(target)
        pointer, nbytes = block.data_ptr(), block.numel() * block.element_size()
        if pointer in self.blocks:
            return True
        if not backend.can_pin or label in self.failed or (capped and self.pinned_bytes + nbytes > self.max_bytes):
            return False
        if not backend.pin(pointer, nbytes):
            self.failed.add(label)
            log.info(
                "[Device Control] host memory could not be page-locked (%s); copies to %s will block",
                backend.take_error(),  # read back now: left pending, the next kernel would raise it as its own
                label,
            )
            return False
        # Unlocked when the tensor goes; a view that outlives it then copies as pageable memory: slower, correct.
        self.blocks[pointer] = (nbytes, target, weakref.finalize(block, self._release, pointer))
        return True

    def unlock(self, block: torch.Tensor) -> None:
        """Undo :meth:`lock`: the block stays, as pageable memory (its weights keep living in it)."""
        entry = self.blocks.get(block.data_ptr())
        if entry is not None:
            entry[2].detach()
            self._release(block.data_ptr())

    def _release(self, pointer: int) -> None:
        entry = self.blocks.pop(pointer, None)
        if entry is not None:
            backend_of(entry[1]).unpin(pointer)

    def retry(self) -> None:
        """Try pinning again on devices where it failed (once per load: a failure under memory pressure, or for
        one range, must not turn pinning off for the rest of the process)."""
        self.failed.clear()

    def pin(self, tensor: torch.Tensor, target: Target) -> bool:
        """Pin ``tensor``'s host memory in place for copies to ``target``; ``False`` (and nothing changes) when
        that cannot be done: the backend cannot pin, the cap is reached, the memory is locked already, or pinning
        failed since the last :meth:`retry`."""
        label, backend = label_of(target), backend_of(target)
        if not backend.can_pin or label in self.failed or not backend_of(target_of(tensor)).is_host:
            return False
        size = tensor.untyped_storage().nbytes()
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in self.pinned or self.pinned_bytes + size > self.max_bytes:
            return False
        if backend.is_pinned(tensor):  # locked already (a ring's slab, ComfyUI's own pinned memory): locking it
            return False  # again fails, and the runtime would report that failure at the next kernel launch
        if not backend.pin(pointer, size):  # e.g. a locked-memory limit: stop trying; copies stay correct
            self.failed.add(label)
            log.info(
                "[Device Control] pinning host memory failed (%s); weight copies to %s will be blocking",
                backend.take_error(),  # read back now: left pending, the next kernel would raise it as its own
                label,
            )
            return False
        self.pinned[pointer] = (size, target)
        return True

    def unpin(self, tensor: torch.Tensor) -> None:
        """Undo :meth:`pin` for ``tensor`` (before it is freed or moved)."""
        if not self.pinned:
            return
        entry = self.pinned.pop(tensor.untyped_storage().data_ptr(), None)
        if entry is not None:
            backend_of(entry[1]).unpin(tensor.untyped_storage().data_ptr())


_pinned: PinnedMemory | None = None


def pinned_memory() -> PinnedMemory:
    """The process's pinned-memory account (one cap for every model)."""
    global _pinned
    if _pinned is None:
        _pinned = PinnedMemory()
    return _pinned
