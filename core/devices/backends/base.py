"""The device backend interface: what every kind of device answers, whatever drives it.

A backend serves all devices of one kind (CUDA, XPU, the host, the simulated GPU, ...). It answers for its
devices, each named by a *target* (a ``torch.device``, or a device object of its own such as a simulated GPU):

* identity and capabilities: the probe (:meth:`DeviceBackend.devices`) and the target behind a device;
* memory: total, free (the allocator's cache counted as free), giving the cache back;
* moving tensors: in place for a module's weights, and a copy for one use;
* streams and events: real where the backend has them, ordered no-ops where it has none;
* pinned host memory, and synchronising.

Production code asks a backend (``backend_of(target)``) and never which kind of device it is talking to; the
defaults here are those of a device torch drives itself with no streams (the host, MPS, DirectML).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import psutil
import torch


@dataclass(frozen=True)
class DeviceInfo:
    """One device and its memory, as seen at one moment.

    ``id`` is what users write (``gpu:0``, ``cpu``); ``native`` is the backend's own name for the device
    (``cuda:0``, ``xpu:0``, ``mps``, ``privateuseone:0``, ``sim:0``).
    Memory figures are bytes, or ``None`` where the backend cannot tell. ``free`` is what the driver
    reports free; memory torch has reserved but not allocated (its cache) is counted in
    ``torch_reserved`` and can be given back with ``empty_cache``. ``peak_allocated`` is the most torch
    held at once: as a backend reports it, its peak counter; in an inventory's snapshot, the peak since the VRAM
    Report's previous report (:meth:`DeviceInventory.reset_peaks`), which ``peak_bounded`` marks as only a lower
    bound (no new high was set since, and the counters are not reset: ``core.devices.peaks``).
    ``utilization`` (percent of the last sample period the device was busy) and ``temperature`` (degrees Celsius)
    are what the driver reports, or ``None`` where the backend cannot tell (the CPU, the simulated GPU, a CUDA
    build without the NVIDIA/AMD management library).
    """

    id: str
    kind: str
    name: str
    native: str
    total: int | None
    free: int | None
    torch_allocated: int | None = None
    torch_reserved: int | None = None
    used_by_others: int | None = None
    dtypes: tuple[str, ...] = ("fp32",)
    error: str | None = None
    peak_allocated: int | None = None
    torch_visible: bool = True
    peak_bounded: bool = False
    utilization: int | None = None
    temperature: int | None = None

    @property
    def used(self) -> int | None:
        """Bytes in use by anyone (total minus free)."""
        if self.total is None or self.free is None:
            return None
        return self.total - self.free

    @property
    def torch_device(self) -> str | None:
        """The ``torch.device`` string of the device; ``None`` where torch does not know the device."""
        return self.native if self.torch_visible else None

    @property
    def is_accelerator(self) -> bool:
        """True for every device but the CPU."""
        return self.kind != "cpu"


@dataclass(frozen=True)
class HiddenDevices:
    """Devices the driver has that this process does not see, and the setting that hides them."""

    count: int
    total: int
    setting: str | None = None

    def sentence(self, kind: str) -> str:
        """What a user reads, with what to start ComfyUI with."""
        why = f" ({self.setting} hides the others)" if self.setting else ""
        return (
            f"ComfyUI sees {self.total - self.count} of the {self.total} {kind} GPUs the driver has{why}: to use "
            "them all, start ComfyUI with --cuda-device all and leave CUDA_VISIBLE_DEVICES unset (on Windows "
            "ComfyUI uses GPU 0 alone unless started so)."
        )


#: The settings that hide GPUs from a process, in the order they are read.
VISIBILITY_SETTINGS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


def visibility_setting(environ: Mapping[str, str] | None = None) -> str | None:
    """``NAME=value`` of the first visibility setting this process was started with, or ``None``."""
    env = os.environ if environ is None else environ
    return next((f"{name}={env[name]}" for name in VISIBILITY_SETTINGS if name in env), None)


@runtime_checkable
class DeviceObject(Protocol):
    """A device torch does not know, represented by an object of its backend's (see ``register_device_type``)."""

    label: str


#: Where a model or a tensor lives: a device torch knows, or a device object of a backend.
Target = torch.device | DeviceObject
HOST = torch.device("cpu")


class DeviceBackend:
    """One kind of device. Subclasses override what their kind does differently.

    Class attributes:
        name: the kind, as reports show it.
        is_host: its devices are host memory (a model there is resident in full; nothing streams).
        comfy_makes_room: ComfyUI frees memory on its devices before a load (true for every device ComfyUI
            knows); where it does not, the product makes the room itself.
        can_pin: it can page-lock host memory for faster copies (:meth:`pin`).
    """

    name = ""
    is_host = False
    comfy_makes_room = True
    can_pin = False

    # -- identity --------------------------------------------------------------------------------

    def available(self) -> bool:
        """Whether this backend exists in this torch build and has at least one device."""
        return False

    def devices(self) -> list[DeviceInfo]:
        """Query every device of this backend now (ids are assigned later by the inventory)."""
        return []

    def hidden_devices(self) -> HiddenDevices | None:
        """The devices of this kind the driver has and this process does not see (``None``: none, or cannot
        tell)."""
        return None

    def reset_peaks(self) -> None:
        """Start measuring each device's peak allocation again from now (a no-op where there is none). The counter
        is global (other tools read torch's): the inventory calls this only under ``DEVICE_CONTROL_PEAKS=reset``."""

    def target_for(self, info: DeviceInfo) -> Target:
        """The target that places a model on the device ``info`` describes."""
        return torch.device(info.native)

    def label(self, target: Target) -> str:
        """How errors and logs name ``target`` (``cuda:0``, ``sim:0``)."""
        return str(target)

    def comfy_device(self, target: Target) -> torch.device:
        """The torch device ComfyUI computes on when a model is placed on ``target``."""
        return target

    def empty(self, target: Target, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised memory on ``target`` for a loader to write weights into as it reads them, so a model
        is filled where it lives and never staged whole in RAM.

        Raises:
            torch.OutOfMemoryError: ``target`` has no room for it.
        """
        return torch.empty(shape, dtype=dtype, device=target)

    # -- memory ----------------------------------------------------------------------------------

    def free(self, target: Target) -> int:
        """Bytes a new allocation on ``target`` may take now (the allocator's cache included)."""
        raise _no_memory_figures(target)

    def capacity(self, target: Target) -> int:
        """The total memory of ``target``."""
        raise _no_memory_figures(target)

    def empty_cache(self, target: Target) -> None:
        """Give the memory the allocator keeps cached on ``target`` back to the device."""

    # -- tensors ---------------------------------------------------------------------------------

    def holds(self, tensor: torch.Tensor, target: Target) -> bool:
        """Whether ``tensor`` is resident on ``target``."""
        return getattr(tensor, "placement_target", None) is None and tensor.device == target

    def release(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` ready to leave this backend's device: where a device keeps its own books, it stops
        counting the tensor (the data itself moves with the next :meth:`adopt`)."""
        return tensor

    def adopt(self, tensor: torch.Tensor, target: Target) -> None:
        """Move a parameter or buffer onto ``target`` keeping its identity (``Module.to`` style)."""
        tensor.data = tensor.data.to(target)

    def place(self, tensor: torch.Tensor, target: Target) -> torch.Tensor:
        """``tensor`` moved onto ``target`` (a new tensor; used for buffers, which are replaced)."""
        return tensor.to(target)

    def copy_to(
        self, tensor: torch.Tensor, target: Target, *, non_blocking: bool = False, copy: bool = False
    ) -> torch.Tensor:
        """``tensor`` copied to ``target`` on the current stream (without the host waiting when
        ``non_blocking``, from pinned memory). ``copy``: the result will be changed in place, so it must not
        share memory with ``tensor`` (a copy to another device never does)."""
        return tensor.to(target, non_blocking=non_blocking, copy=True)

    # -- streams and events ----------------------------------------------------------------------

    def side_stream(self, target: Target) -> Any | None:
        """The copy stream of ``target`` (one per device), or ``None`` where the backend has no streams."""
        return None

    def current_stream(self, target: Target) -> Any | None:
        """The stream computations on ``target`` run on now (``None`` without streams)."""
        return None

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        """Make ``stream`` the current one inside the ``with`` block."""
        return contextlib.nullcontext()

    def record(self, stream: Any) -> Any | None:
        """An event marking the work queued on ``stream`` so far (``None`` without streams)."""
        return None

    def wait(self, stream: Any, event: Any) -> None:
        """Order the work queued on ``stream`` from now after ``event`` (the host does not wait)."""

    def synchronize(self, target: Target) -> None:
        """Wait on the host until everything queued on ``target`` is done."""

    def wait_host(self, event: Any) -> None:
        """Wait on the host until the work ``event`` marks is done (before the host writes to or frees memory a
        copy may still read or write)."""

    def copy_into(self, destination: torch.Tensor, source: torch.Tensor, *, non_blocking: bool) -> None:
        """Copy ``source`` into ``destination`` (memory of this backend's device) on the current stream, one copy
        for the whole range: how a group of streamed weights crosses (``core.placement.ring``)."""
        destination.copy_(source, non_blocking=non_blocking)

    # -- pinned host memory ----------------------------------------------------------------------

    def pin(self, pointer: int, size: int) -> bool:
        """Page-lock ``size`` bytes of host memory at ``pointer`` for fast copies to this backend's devices;
        ``False`` where it cannot (then copies are blocking, and still correct).

        Locking works in whole pages: a range that touches a page already locked (by anyone) fails. A failure
        leaves the runtime's error pending, to be raised by the next computation or copy on a device, until
        :meth:`take_error` reads it: call it right after a failed pin."""
        return False

    def unpin(self, pointer: int) -> bool:
        """Undo :meth:`pin` (``pointer`` is where a locked range starts); ``False`` when the runtime refused, with
        its error pending until :meth:`take_error` reads it."""
        return True

    def reads_errors(self) -> bool:
        """Whether :meth:`take_error` can read a failed call's error back on this system; where it cannot,
        nothing may be registered (a failure would stay pending and fail the next computation)."""
        return True

    def take_error(self) -> str | None:
        """Read and clear the error a failed runtime call (a failed :meth:`pin`) left pending for this host thread,
        so that no later computation reports it as its own; its text, or ``None`` when there was none."""
        return None

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether copies of ``tensor`` to this backend's devices can run without the host waiting."""
        return False


def _no_memory_figures(target: Target) -> Exception:
    from ...errors import DeviceControlError

    return DeviceControlError(
        f"the memory of {target} cannot be read with this torch; update torch, or choose another device."
    )


_process: psutil.Process | None = None


def this_process() -> psutil.Process:
    """This process, as psutil sees it; kept, since making one reads ``/proc`` (renewed after a fork)."""
    global _process
    if _process is None or _process.pid != os.getpid():
        _process = psutil.Process()
    return _process


@functools.cache
def installed(module: str) -> bool:
    """Whether ``module`` can be imported (asked once: a package does not appear while the server runs)."""
    return importlib.util.find_spec(module) is not None


def dtypes_from(fp16: bool, bf16: bool, fp8: bool) -> tuple[str, ...]:
    """The compute dtypes a device supports, as reports name them."""
    flags = (("fp16", fp16), ("bf16", bf16), ("fp8", fp8))
    return ("fp32", *(name for name, ok in flags if ok))


def describe(exc: BaseException) -> str:
    """``Type: message``, for reports of a failed query."""
    return f"{type(exc).__name__}: {exc}"
