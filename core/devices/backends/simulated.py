"""The simulated GPU as a backend: the same interface, and the same calls, as a real accelerator.

Its devices are :class:`~core.devices.sim.device.SimulatedDevice` objects, which torch does not know: ComfyUI
computes on the host for them (``comfy_device``) and does not make room on them (``comfy_makes_room``).
Everything else is what a CUDA device does, and fails where CUDA fails: a loader fills weights straight onto it
(``empty``; the bytes cross the link once), a copy stream and events with CUDA's ordering rules (checked: a missing
wait raises), host memory page-locked in whole pages (a range touching a registered page fails, and the error stays
pending for the next operation until :meth:`SimulatedBackend.take_error` reads it: ``core.devices.sim.host``),
copies from it that overlap the host's work while copies from pageable memory hold the host, blocking copies that
wait for the whole device, and a host that must wait for a queued copy before it writes to or frees its source.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ..host_memory import platform
from ..sim.device import SimulatedDevice
from ..sim.host import NOT_SUPPORTED, REGISTRY
from ..sim.link import SimEvent, SimStream
from ..sim.tensor import SimTensor, own_storage, take_snapshot
from .base import DeviceBackend, DeviceInfo, HiddenDevices, Target, describe, visibility_setting

#: The compute dtypes a simulated GPU reports (it computes on the host, which has them all but fp8).
DTYPES = ("fp32", "fp16", "bf16")


class SimulatedBackend(DeviceBackend):
    """The simulated GPUs the settings asked for (``DEVICE_CONTROL_SIMULATE_GPU``), numbered after real ones.

    Args:
        devices: the simulated devices this backend reports in inventories (none: it serves only moves to
            devices made elsewhere, such as in tests).
        hidden: the simulated devices a visibility setting hides, as a driver would report them.
    """

    name = "simulated"
    comfy_makes_room = False

    @property
    def can_pin(self) -> bool:
        """Host memory can be page-locked for it, except on a platform of unified memory (Apple's, where a
        simulated GPU is like MPS: no registration, no streams)."""
        return not platform().unified_memory

    def __init__(self, devices: Sequence[SimulatedDevice] = (), hidden: HiddenDevices | None = None) -> None:
        self.simulated = tuple(devices)
        self.hidden = hidden

    # -- identity --------------------------------------------------------------------------------

    def available(self) -> bool:
        return bool(self.simulated)

    def devices(self) -> list[DeviceInfo]:
        return [_info(device) for device in self.simulated]

    def hidden_devices(self) -> HiddenDevices | None:
        return self.hidden

    def reset_peaks(self) -> None:
        for device in self.simulated:
            device.reset_peak()

    def target_for(self, info: DeviceInfo) -> Target:
        return next(device for device in self.simulated if device.label == info.native)

    def label(self, target: Target) -> str:
        return target.label

    def comfy_device(self, target: Target) -> torch.device:
        return torch.device("cpu")

    def empty(self, target: Target, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return target.place(torch.empty(shape, dtype=dtype))

    # -- memory ----------------------------------------------------------------------------------

    def free(self, target: Target) -> int:
        return target.free()

    def capacity(self, target: Target) -> int:
        return target.capacity

    # -- tensors ---------------------------------------------------------------------------------

    def holds(self, tensor: torch.Tensor, target: Target) -> bool:
        return isinstance(tensor, SimTensor) and tensor.sim_device is target

    def release(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.sim_device.release(tensor) if isinstance(tensor, SimTensor) else tensor

    def adopt(self, tensor: torch.Tensor, target: Target) -> None:
        target.place_in_place(tensor)  # a view of a slab is booked for its own bytes, as CUDA allocates them

    def place(self, tensor: torch.Tensor, target: Target) -> torch.Tensor:
        return target.place(tensor)

    def copy_to(
        self, tensor: torch.Tensor, target: Target, *, non_blocking: bool = False, copy: bool = False
    ) -> torch.Tensor:
        # The device shares host storage: a copy that will be changed (patched) must not be the stored weight,
        # and a copy of part of a weight (a row slice) is booked for its own bytes, not the whole storage's.
        # From another simulated device the source stays where it is. A blocking copy (an activation between the
        # parts of a split model, which the next block may change in place) gets memory of its own; a queued one
        # (a donor GPU's weight streamed ahead, only read) shares the host memory, as a copy between two GPUs
        # costs the host nothing: its cost is the link's time.
        from_device = isinstance(tensor, SimTensor) and tensor.sim_device is not target
        if from_device:
            if non_blocking and not copy:
                with torch._C.DisableTorchFunctionSubclass():
                    tensor = tensor.detach().as_subclass(torch.Tensor)
            else:
                tensor = tensor.cpu()
        pinned = from_device or self.is_pinned(tensor)  # from another device: no staging
        source = tensor.detach().clone() if copy else own_storage(tensor.detach())
        stream = target.link.current
        placed = target.place(source, host_waits=not non_blocking, pinned=pinned)
        _reads_until_waited(target, tensor, stream, queued=non_blocking, pinned=pinned, from_device=from_device)
        if not copy and placed is not tensor:  # shares the source's memory: a write to it must not be missed
            take_snapshot(placed)
        return placed

    # -- streams and events ----------------------------------------------------------------------

    def side_stream(self, target: Target) -> SimStream | None:
        return None if platform().unified_memory else target.link.side

    def current_stream(self, target: Target) -> SimStream | None:
        return None if platform().unified_memory else target.link.current

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        return _on(stream)

    def record(self, stream: Any) -> SimEvent | None:
        return None if stream is None else stream.link.record(stream)

    def wait(self, stream: Any, event: Any) -> None:
        if stream is not None:
            stream.link.wait(stream, event)

    def synchronize(self, target: Target) -> None:
        target.link.synchronize()

    def wait_host(self, event: Any) -> None:
        if event is not None:
            event.stream.link.wait_host(event)

    def copy_into(self, destination: torch.Tensor, source: torch.Tensor, *, non_blocking: bool) -> None:
        destination.sim_device.copy_into(
            destination, source, pinned=self.is_pinned(source), host_waits=not non_blocking
        )

    # -- pinned host memory ----------------------------------------------------------------------

    def pin(self, pointer: int, size: int) -> bool:
        if platform().unified_memory:  # as MPS: host memory is the device's, there is nothing to register
            REGISTRY.refuse(NOT_SUPPORTED)
            return False
        return REGISTRY.register(pointer, size)

    def unpin(self, pointer: int) -> bool:
        return REGISTRY.unregister(pointer)

    def take_error(self) -> str | None:
        return REGISTRY.take_error()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        # As CUDA answers it: whether the tensor lies in a registered range (a view of a locked slab is pinned).
        return not isinstance(tensor, SimTensor) and REGISTRY.holds(
            tensor.data_ptr(), tensor.numel() * tensor.element_size()
        )


@contextlib.contextmanager
def _on(stream: SimStream) -> Iterator[None]:
    link = stream.link
    previous = link.set_current(stream)
    try:
        yield
    finally:
        link.set_current(previous)


def _info(device: SimulatedDevice) -> DeviceInfo:
    """The device as the inventory reports it; a failing statistics query is reported like a driver's."""
    try:
        stats = device.stats()
    except Exception as exc:  # an injected (or real) failure is reported like a driver failure
        return DeviceInfo("", device.kind, device.name, device.label, None, None, error=describe(exc))
    return DeviceInfo(
        "",
        device.kind,
        device.name,
        device.label,
        stats["total"],
        stats["free"],
        stats["torch_allocated"],
        stats["torch_reserved"],
        stats["used_by_others"],
        DTYPES,
        peak_allocated=stats["peak_allocated"],
        torch_visible=False,
    )


def simulated_backends(
    devices: Sequence[SimulatedDevice], environ: Mapping[str, str] | None = None
) -> list[DeviceBackend]:
    """What the settings add to the inventory for ``devices``: their backend, or nothing without devices. As a
    CUDA driver does, ``CUDA_VISIBLE_DEVICES`` (ComfyUI sets it to ``0`` on Windows unless started with
    ``--cuda-device all``) keeps the devices it lists, in its order, and the backend reports the others hidden."""
    if not devices:
        return []
    setting = visibility_setting(environ)
    if setting is None:
        return [SimulatedBackend(devices)]
    visible = [devices[index] for index in _listed(setting.split("=", 1)[1]) if index < len(devices)]
    hidden = HiddenDevices(len(devices) - len(visible), len(devices), setting) if len(visible) < len(devices) else None
    return [SimulatedBackend(visible, hidden)]


def _listed(value: str) -> list[int]:
    """The device numbers a visibility setting lists, read as CUDA reads them: up to the first that is not one."""
    listed: list[int] = []
    for item in value.split(","):
        if not item.strip().isdigit():
            break
        if int(item) not in listed:
            listed.append(int(item))
    return listed


def _reads_until_waited(
    target: SimulatedDevice, source: torch.Tensor, stream: SimStream, *, queued: bool, pinned: bool, from_device: bool
) -> None:
    """A copy from ``source`` was just put on ``stream``: one ``queued`` (the host did not wait) from ``pinned`` host
    memory (not ``from_device``) reads that memory until the host waits for it, as a ring's fill does
    (``core.devices.sim.host``), whatever path queued it (a tensor moved on its own, a LoRA factor)."""
    if queued and pinned and not from_device and source.is_contiguous():
        target.link.reads.add(source, stream, stream.queued)
