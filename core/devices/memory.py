"""Memory of one placement target right now: what is free, how big it is, and giving cached memory back.

The inventory (``core.devices``) describes every device for reports; the loading engine needs these three
questions answered fast, for the one device it is filling, and the same way for a real backend, the host
and a :class:`~core.simulated.SimulatedDevice`. Memory the backend's allocator holds in its cache counts as
free: it is ours to reuse.
"""

from __future__ import annotations

import gc
from typing import Any

import psutil
import torch

from ..errors import DeviceControlError
from .simulated import SimulatedDevice
from .tensors import Target


def _backend(device: torch.device) -> Any:  # torch.cuda, torch.xpu, ... (or None)
    return getattr(torch, device.type, None)


def _free_and_total(device: torch.device) -> tuple[int, int]:
    backend = _backend(device)
    if hasattr(backend, "mem_get_info"):
        free, total = backend.mem_get_info(device)
        cached = int(backend.memory_reserved(device)) - int(backend.memory_allocated(device))
        return int(free) + max(0, cached), int(total)
    if device.type == "mps":
        total = int(backend.recommended_max_memory())
        return total - int(backend.driver_allocated_memory()), total
    raise DeviceControlError(
        f"the memory of {device} cannot be read with this torch; update torch, or choose another device."
    )


def free_bytes(target: Target) -> int:
    """Bytes a new allocation on ``target`` may take now (the allocator's cache included)."""
    if isinstance(target, SimulatedDevice):
        return target.free()
    if target.type == "cpu":
        return int(psutil.virtual_memory().available)
    return _free_and_total(target)[0]


def capacity_bytes(target: Target) -> int:
    """The total memory of ``target``."""
    if isinstance(target, SimulatedDevice):
        return target.capacity
    if target.type == "cpu":
        return int(psutil.virtual_memory().total)
    return _free_and_total(target)[1]


def empty_cache(target: Target) -> None:
    """Give memory the allocator keeps cached on ``target`` back to the device (after a collection, so
    tensors that only cycles kept alive go too)."""
    gc.collect()
    if isinstance(target, SimulatedDevice):
        target.empty_cache()
        return
    backend = _backend(target)
    if target.type != "cpu" and backend is not None and hasattr(backend, "empty_cache"):
        backend.empty_cache()
