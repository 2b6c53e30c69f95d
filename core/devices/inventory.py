"""Which devices this machine has, how much memory each has free, and what a device string means.

The :class:`DeviceInventory` asks every backend probe (``core.devices.backends``), and the backends the settings
add, for its devices, numbers accelerators ``gpu:0``, ``gpu:1``, ...
(ComfyUI core's convention), and never lets a failing probe take the others down: a probe that raises is
reported in :attr:`InventorySnapshot.backends` with its error.

Device strings accepted from users: ``auto``, ``cpu``, ``gpu:N``, and the backend names ``cuda:N``,
``xpu:N``, ``npu:N``, ``mlu:N``, ``mps``, ``directml:N``, and the labels the added backends give their devices.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import psutil
import torch

from ..errors import DeviceNotFoundError, InvalidDeviceSpecError
from .backends import (
    DeviceBackend,
    DeviceInfo,
    HiddenDevices,
    Target,
    backend_of,
    default_backends,
    this_process,
)
from .peaks import RESET, Mark, Peak, interval_peak, peaks_from_env

log = logging.getLogger("device_control")

__all__ = [
    "BackendStatus",
    "DeviceInfo",
    "DeviceInventory",
    "DeviceSpec",
    "HostMemory",
    "InventorySnapshot",
    "Resolution",
    "parse_device_spec",
]

_SPEC_RE = re.compile(r"^(auto|cpu|gpu|cuda|xpu|npu|mlu|mps|directml|privateuseone|sim)(?::(\d+))?$")
_ACCEPTED = "auto, cpu, gpu:N, cuda:N, xpu:N, npu:N, mlu:N, mps, directml:N or sim:N"


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed device string: ``kind`` is one of the accepted words, ``index`` defaults to 0."""

    kind: str
    index: int = 0

    def __str__(self) -> str:
        if self.kind in ("auto", "cpu", "mps"):
            return self.kind
        return f"{self.kind}:{self.index}"


def parse_device_spec(text: str) -> DeviceSpec:
    """Parse a device string such as ``"gpu:1"`` or ``"CUDA:0"`` (case and spaces do not matter).

    Raises:
        InvalidDeviceSpecError: the text is not one of the accepted forms.
    """
    match = _SPEC_RE.match(str(text).strip().lower())
    if match is None:
        raise InvalidDeviceSpecError(f"{text!r} is not a device; use one of: {_ACCEPTED}.")
    kind = "directml" if match.group(1) == "privateuseone" else match.group(1)
    index = int(match.group(2) or 0)
    if kind in ("auto", "cpu", "mps") and match.group(2) is not None and index != 0:
        raise InvalidDeviceSpecError(f"{text!r}: '{kind}' takes no index; write just '{kind}'.")
    return DeviceSpec(kind, index)


@dataclass(frozen=True)
class BackendStatus:
    """How one backend's probe went: available or not, how many devices, or the error it raised."""

    name: str
    available: bool
    device_count: int = 0
    error: str | None = None
    hidden: HiddenDevices | None = None


@dataclass(frozen=True)
class HostMemory:
    """System RAM and this process's resident set size, in bytes."""

    total: int
    available: int
    process_rss: int

    @property
    def used(self) -> int:
        """Bytes of RAM in use by anyone."""
        return self.total - self.available


@dataclass(frozen=True)
class InventorySnapshot:
    """Every device and backend at one moment."""

    devices: tuple[DeviceInfo, ...]
    backends: tuple[BackendStatus, ...]
    host: HostMemory

    def get(self, device_id: str) -> DeviceInfo | None:
        """The device with this id (``"gpu:0"``, ``"cpu"``), or ``None``."""
        return next((d for d in self.devices if d.id == device_id), None)

    @property
    def notes(self) -> list[str]:
        """What a user should know about the devices: GPUs the driver has that ComfyUI does not see, and how to
        see them all."""
        return [b.hidden.sentence(b.name) for b in self.backends if b.hidden is not None]

    @property
    def errors(self) -> list[str]:
        """Every backend or device query that failed, as ``"<where>: <error>"`` lines."""
        lines = [f"{b.name}: {b.error}" for b in self.backends if b.error]
        lines += [f"{d.id or d.native}: {d.error}" for d in self.devices if d.error]
        return lines


@dataclass(frozen=True)
class Resolution:
    """The device a device string resolved to, and a warning when it fell back to another one."""

    device: DeviceInfo
    requested: str
    warning: str | None = None


@dataclass
class DeviceInventory:
    """All devices: those every backend probe finds, then those of the backends the settings add (numbered after
    the real accelerators).

    Two measures of each device's peak allocation run side by side, each from its own start: the VRAM Report's,
    since the previous report (:meth:`snapshot`, restarted by :meth:`reset_peaks`), and the memory profile's,
    since its previous reading (:meth:`take_reading`); the report's interval counts the profile's readings taken
    inside it. With ``peak_mode`` ``keep`` no backend's peak counter is ever reset (``core.devices.peaks``).

    Args:
        backends: the probes to ask (default: every backend torch may have).
        extra: backends the settings add (the simulated GPUs of ``DEVICE_CONTROL_SIMULATE_GPU``).
        peak_mode: ``keep`` or ``reset`` (default: ``DEVICE_CONTROL_PEAKS``, else ``keep``).
    """

    backends: Sequence[DeviceBackend] = field(default_factory=default_backends)
    extra: Sequence[DeviceBackend] = ()
    peak_mode: str = field(default_factory=peaks_from_env)
    #: Where each measure's current interval started, by device id (absent: when the counter itself started).
    _report_start: dict[str, Mark] = field(default_factory=dict, init=False, repr=False)
    _reading_start: dict[str, Mark] = field(default_factory=dict, init=False, repr=False)
    #: The highest peak the profile's readings took inside the report's interval, by device id.
    _carried: dict[str, Peak] = field(default_factory=dict, init=False, repr=False)
    #: Whether the profile's current reading began inside the report's interval (only then is its peak carried).
    _reading_inside: bool = field(default=True, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def _probes(self) -> list[DeviceBackend]:
        """The probes in numbering order: real accelerators, then the added ones (the host is not numbered)."""
        return [*self.backends, *self.extra]

    def snapshot(self) -> InventorySnapshot:
        """Query every backend now, each device's peak since the previous report. Never raises because a backend
        failed."""
        queried = self._query()
        with self._lock:
            return replace(queried, devices=tuple(self._report_peaks(queried.devices)))

    def _query(self) -> InventorySnapshot:
        """Every backend's answer now, its peaks as the backend counts them."""
        devices: list[DeviceInfo] = []
        statuses: list[BackendStatus] = []
        next_gpu = 0
        for backend in self._probes():
            try:
                if not backend.available():
                    statuses.append(BackendStatus(backend.name, False))
                    continue
                found = backend.devices()
            except Exception as exc:  # a broken driver is reported, never fatal
                statuses.append(BackendStatus(backend.name, False, error=f"{type(exc).__name__}: {exc}"))
                continue
            for info in found:
                if info.kind != "cpu":
                    info = _with_id(info, f"gpu:{next_gpu}")
                    next_gpu += 1
                devices.append(info)
            statuses.append(BackendStatus(backend.name, True, len(found), hidden=_hidden(backend)))
        return InventorySnapshot(tuple(devices), tuple(statuses), host_memory())

    def _report_peaks(self, devices: Sequence[DeviceInfo]) -> Iterator[DeviceInfo]:
        """``devices`` with the peak of the report's interval (under the lock)."""
        marks = _marks(devices)
        for info in devices:
            if info.id in marks:
                peak = interval_peak(self._report_start.get(info.id), marks[info.id], self._carried.get(info.id))
                info = replace(info, peak_allocated=peak.value, peak_bounded=not peak.exact)
            yield info

    def take_reading(self) -> tuple[InventorySnapshot, dict[str, Peak]]:
        """A snapshot (its peaks the report's), and each device's peak since the previous reading, by device id: a
        shorter measure (one node of a profile) inside the longer one the VRAM Report reads, which counts it.
        Never raises (a device that fails is left out of the peaks)."""
        queried = self._query()
        marks = _marks(queried.devices)
        restart = self.peak_mode == RESET
        if restart:
            self._restart_backends()
        with self._lock:
            peaks = {device: interval_peak(self._reading_start.get(device), mark) for device, mark in marks.items()}
            if self._reading_inside:
                for device, peak in peaks.items():
                    held = self._carried.get(device)
                    self._carried[device] = peak if held is None or peak.value > held.value else held
            self._reading_start, self._reading_inside = ({} if restart else marks), True
            devices = tuple(self._report_peaks(queried.devices))
        return replace(queried, devices=devices), peaks

    def reset_peaks(self) -> None:
        """Start the VRAM Report's measure of every device's peak again from now. Under ``keep`` it notes each
        counter where it stands; under ``reset`` it resets the counters. Never raises: a backend that fails keeps
        its old peak, which only makes the next figure larger, never wrong the other way."""
        if self.peak_mode == RESET:
            self._restart_backends()
            marks: dict[str, Mark] = {}
        else:
            marks = _marks(self._query().devices)
        with self._lock:
            self._carried.clear()
            self._report_start = marks
            if self.peak_mode == RESET:  # the profile's counters started again too
                self._reading_start = {}
            else:  # the profile's current reading began before: its peak may be from before this report
                self._reading_inside = False

    def _restart_backends(self) -> None:
        for backend in self._probes():
            try:
                if backend.available():
                    backend.reset_peaks()
            except Exception as exc:  # a broken driver query must not fail a report
                log.debug("[Device Control] could not reset the peaks of %s: %s", backend.name, exc)

    def target(self, device_id: str, snapshot: InventorySnapshot | None = None) -> Target:
        """What places a model on the device ``device_id`` (``"gpu:N"``, ``"cpu"``): a ``torch.device``, or
        the device object of a backend torch does not know.

        Raises:
            DeviceNotFoundError: there is no such device.
        """
        snapshot = snapshot or self.snapshot()
        info = snapshot.get(device_id)
        if info is None:
            raise DeviceNotFoundError(f"device '{device_id}' does not exist on this machine.")
        backend = next((b for b in self._probes() if b.name == info.kind), None)
        return backend.target_for(info) if backend is not None else torch.device(info.native)

    def empty_caches(self) -> None:
        """Give the memory every device's allocator keeps cached back to its device."""
        snapshot = self.snapshot()
        for info in snapshot.devices:
            if info.id and info.error is None:
                target = self.target(info.id, snapshot)
                backend_of(target).empty_cache(target)

    def resolve(self, text: str, *, fallback: bool = False, snapshot: InventorySnapshot | None = None) -> Resolution:
        """Resolve a device string to a device of this machine.

        Args:
            text: what the user wrote (see the module docstring for the accepted forms).
            fallback: when the device does not exist here, use what ``auto`` picks and say so in
                :attr:`Resolution.warning` (portable workflows) instead of raising.
            snapshot: an inventory snapshot to resolve against (default: a fresh one).

        Raises:
            InvalidDeviceSpecError: the string is malformed (even with ``fallback``: it is a typo).
            DeviceNotFoundError: the device does not exist here and ``fallback`` is off.
        """
        spec = parse_device_spec(text)
        snapshot = snapshot or self.snapshot()
        found = _find(spec, snapshot)
        if found is not None:
            return Resolution(found, str(spec))
        here = ", ".join(f"{d.id} ({d.name})" for d in snapshot.devices if d.id) or "none"
        problem = f"device '{spec}' does not exist on this machine (devices here: {here})"
        if not fallback:
            raise DeviceNotFoundError(problem, "pick one of those, or 'auto'.")
        chosen = _find(DeviceSpec("auto"), snapshot)
        if chosen is None:
            raise DeviceNotFoundError(f"{problem}, and no device is usable at all; check the errors above.")
        return Resolution(chosen, str(spec), f"{problem}; using {chosen.id} instead.")


def _find(spec: DeviceSpec, snapshot: InventorySnapshot) -> DeviceInfo | None:
    if spec.kind == "auto":
        return next(_usable_accelerators(snapshot), None) or snapshot.get("cpu")
    if spec.kind in ("cpu", "gpu"):
        return snapshot.get("cpu" if spec.kind == "cpu" else f"gpu:{spec.index}")
    native = {"mps": "mps", "directml": f"privateuseone:{spec.index}"}.get(spec.kind, f"{spec.kind}:{spec.index}")
    return next((d for d in snapshot.devices if d.native == native), None)


def _usable_accelerators(snapshot: InventorySnapshot) -> Iterator[DeviceInfo]:
    """Accelerators with an id whose query did not fail, in the order they are numbered."""
    for device in snapshot.devices:
        if device.id and device.error is None and device.is_accelerator:
            yield device


def _marks(devices: Sequence[DeviceInfo]) -> dict[str, Mark]:
    """Each device's peak counter and allocation, by id (those whose query failed, or with no counter, left out)."""
    return {
        info.id: Mark(info.peak_allocated, info.torch_allocated or 0)
        for info in devices
        if info.id and info.peak_allocated is not None and info.error is None
    }


def _hidden(backend: DeviceBackend) -> HiddenDevices | None:
    try:
        return backend.hidden_devices()
    except Exception:  # a count the driver cannot give is no reason to lose the inventory
        return None


def _with_id(info: DeviceInfo, device_id: str) -> DeviceInfo:
    return DeviceInfo(**{**info.__dict__, "id": device_id})


def host_memory() -> HostMemory:
    """System RAM and this process's RSS, now."""
    memory = psutil.virtual_memory()
    return HostMemory(memory.total, memory.available, this_process().memory_info().rss)
