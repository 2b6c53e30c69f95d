"""Moving weights to the compute device for one use: side streams, pinned host memory, and the simulated GPU.

On CUDA and XPU a streamed weight is copied on a side stream (one per device), non-blocking when its host
memory is pinned, and the compute stream waits for that copy only where it needs the result: earlier layers
still compute while the copy runs. Host memory is pinned in place, up to a cap (a fraction of RAM, default
45 %, ``DEVICE_CONTROL_MAX_PINNED_FRACTION`` to change it); when pinning fails or the cap is reached the copy
is simply blocking. On the CPU and on a :class:`~core.simulated.SimulatedDevice` there is no stream: the same
functions run, and a copy to the simulated device is a placement its books count while the copy lives.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from collections.abc import Iterator, Mapping

import psutil
import torch

from ..errors import InvalidSizeError
from .simtensor import SimTensor
from .simulated import SimulatedDevice
from .tensors import Target

log = logging.getLogger("device_control")

_STREAM_BACKENDS = ("cuda", "xpu")
_streams: dict[torch.device, object] = {}
_streams_lock = threading.Lock()


def compute_target(tensor: torch.Tensor) -> Target:
    """Where a computation on ``tensor`` happens: its simulated device, or its torch device."""
    return tensor.sim_device if isinstance(tensor, SimTensor) else tensor.device


def side_stream(device: torch.device) -> object | None:
    """The copy stream of ``device`` (created once), or ``None`` where the backend has no streams."""
    if device.type not in _STREAM_BACKENDS:
        return None
    with _streams_lock:
        if device not in _streams:
            backend = getattr(torch, device.type)
            _streams[device] = backend.Stream(device=device)
        return _streams[device]


@contextlib.contextmanager
def _on(stream: object) -> Iterator[None]:
    backend = getattr(torch, stream.device.type)
    with backend.stream(stream):
        yield


def to_target(tensor: torch.Tensor, target: Target, *, copy: bool = False) -> torch.Tensor:
    """``tensor`` on ``target`` for one computation (copied only when it is elsewhere, or when ``copy``)."""
    if isinstance(target, SimulatedDevice):
        if isinstance(tensor, SimTensor) and tensor.sim_device is target:
            return tensor.clone() if copy else tensor
        return target.place(tensor.detach().clone() if copy else tensor.detach())
    if tensor.device == target and not isinstance(tensor, SimTensor):
        return tensor.clone() if copy else tensor
    stream = side_stream(target)
    if stream is None:
        return tensor.to(target, copy=True)
    with _on(stream):
        moved = tensor.to(target, non_blocking=tensor.is_pinned(), copy=True)
    current = getattr(torch, target.type).current_stream(target)
    current.wait_stream(stream)  # the compute stream waits here, not the host
    moved.record_stream(current)  # keep the memory until the compute stream is done with it
    return moved


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
    if _pinned is not None and not _pinned.pinned:  # nothing pinned yet: the next account uses the new cap
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
        self.pinned: dict[int, int] = {}  # data pointer -> bytes
        self.failed = False

    @property
    def pinned_bytes(self) -> int:
        """Bytes pinned now."""
        return sum(self.pinned.values())

    def pin(self, tensor: torch.Tensor) -> bool:
        """Pin ``tensor``'s host memory in place; ``False`` (and nothing changes) when that cannot be done."""
        if self.failed or not torch.cuda.is_available() or tensor.device.type != "cpu" or tensor.is_pinned():
            return False
        size = tensor.untyped_storage().nbytes()
        if self.pinned_bytes + size > self.max_bytes:
            return False
        pointer = tensor.untyped_storage().data_ptr()
        if torch.cuda.cudart().cudaHostRegister(pointer, size, 1) != 0:  # cudaHostRegisterPortable
            self.failed = True  # e.g. a locked-memory limit: stop trying, copies stay correct, just blocking
            log.info("[Device Control] pinning host memory failed; weight copies to the GPU will be blocking")
            return False
        self.pinned[pointer] = size
        return True

    def unpin(self, tensor: torch.Tensor) -> None:
        """Undo :meth:`pin` for ``tensor`` (before it is freed or moved)."""
        if not self.pinned:
            return
        pointer = tensor.untyped_storage().data_ptr()
        if self.pinned.pop(pointer, None) is not None:
            torch.cuda.cudart().cudaHostUnregister(pointer)


_pinned: PinnedMemory | None = None


def pinned_memory() -> PinnedMemory:
    """The process's pinned-memory account (one cap for every model)."""
    global _pinned
    if _pinned is None:
        _pinned = PinnedMemory()
    return _pinned
