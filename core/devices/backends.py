"""Probes for each kind of device torch can use: CUDA/ROCm, XPU, NPU, MLU, MPS, DirectML and the CPU.

Every probe is feature-detected (a backend whose torch module or extension is absent is simply not
available) and answers with plain :class:`DeviceInfo` records. A probe may raise; the inventory in
``core.devices`` catches that and reports it, so one broken driver never hides the other devices.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

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
    held at once since the peaks were last reset (:meth:`DeviceInventory.reset_peaks`, which the VRAM
    Report calls, so it reads "since the previous report").
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

    @property
    def used(self) -> int | None:
        """Bytes in use by anyone (total minus free)."""
        if self.total is None or self.free is None:
            return None
        return self.total - self.free

    @property
    def torch_device(self) -> str | None:
        """The ``torch.device`` string of a real device; ``None`` for a simulated one."""
        return None if self.kind == "simulated" else self.native

    @property
    def is_accelerator(self) -> bool:
        """True for every device but the CPU."""
        return self.kind != "cpu"


class Backend(Protocol):
    """What the inventory needs from a probe."""

    name: str

    def available(self) -> bool:
        """Whether this backend exists in this torch build and has at least one device."""
        ...

    def devices(self) -> list[DeviceInfo]:
        """Query every device of this backend now (ids are assigned later by the inventory)."""
        ...

    def reset_peaks(self) -> None:
        """Start measuring each device's peak allocation again from now (a no-op where there is none)."""
        ...


_process: psutil.Process | None = None


def this_process() -> psutil.Process:
    """This process, as psutil sees it; kept, since making one reads ``/proc`` (renewed after a fork)."""
    global _process
    if _process is None or _process.pid != os.getpid():
        _process = psutil.Process()
    return _process


@functools.cache
def _installed(module: str) -> bool:
    """Whether ``module`` can be imported (asked once: a package does not appear while the server runs)."""
    return importlib.util.find_spec(module) is not None


def _dtypes(fp16: bool, bf16: bool, fp8: bool) -> tuple[str, ...]:
    flags = (("fp16", fp16), ("bf16", bf16), ("fp8", fp8))
    return ("fp32", *(name for name, ok in flags if ok))


class TorchModuleBackend:
    """A backend exposed as ``torch.<module>`` with the CUDA-style API (XPU, NPU, MLU share it).

    Args:
        module: the attribute of ``torch`` (``"cuda"``, ``"xpu"``, ``"npu"``, ``"mlu"``).
        kind: the name reports use.
        capabilities: maps the module and a device index to (fp16, bf16, fp8) support.
    """

    def __init__(
        self,
        module: str,
        kind: str,
        capabilities: Callable[[Any, int], tuple[bool, bool, bool]] | None = None,
    ) -> None:
        self.module = module
        self.name = kind
        self._capabilities = capabilities or (lambda _mod, _index: (True, True, False))

    def _torch_module(self) -> Any:
        return getattr(torch, self.module, None)

    def available(self) -> bool:
        mod = self._torch_module()
        return bool(mod is not None and hasattr(mod, "is_available") and mod.is_available())

    def devices(self) -> list[DeviceInfo]:
        mod = self._torch_module()
        return [self._device(mod, index) for index in range(mod.device_count())]

    def _device(self, mod: Any, index: int) -> DeviceInfo:
        torch_device = f"{self.module}:{index}"
        try:
            name = mod.get_device_name(index)
        except Exception as exc:  # a device can fail alone; report it and keep the others
            return DeviceInfo("", self.name, torch_device, torch_device, None, None, error=_describe(exc))
        try:
            allocated = int(mod.memory_allocated(index))
            reserved = int(mod.memory_reserved(index))
            if hasattr(mod, "mem_get_info"):
                free, total = (int(v) for v in mod.mem_get_info(index))
            else:
                total = int(mod.get_device_properties(index).total_memory)
                free = total - reserved
            others = max(0, total - free - reserved)
            dtypes = _dtypes(*self._capabilities(mod, index))
            peak = int(mod.max_memory_allocated(index)) if hasattr(mod, "max_memory_allocated") else None
        except Exception as exc:
            return DeviceInfo("", self.name, name, torch_device, None, None, error=_describe(exc))
        info = DeviceInfo("", self.name, name, torch_device, total, free, allocated, reserved, others, dtypes)
        return replace(info, peak_allocated=peak)

    def reset_peaks(self) -> None:
        mod = self._torch_module()
        if hasattr(mod, "reset_peak_memory_stats"):
            for index in range(mod.device_count()):
                mod.reset_peak_memory_stats(index)


def _cuda_capabilities(mod: Any, index: int) -> tuple[bool, bool, bool]:
    props = mod.get_device_properties(index)
    if torch.version.hip:
        arch = str(getattr(props, "gcnArchName", ""))
        bf16 = arch.startswith(("gfx90a", "gfx94", "gfx95", "gfx11", "gfx12"))
        return True, bf16, arch.startswith(("gfx94", "gfx95", "gfx12"))
    capability = (props.major, props.minor)
    return capability >= (5, 3), capability >= (8, 0), capability >= (8, 9)


class CudaBackend(TorchModuleBackend):
    """NVIDIA CUDA, and AMD ROCm (HIP builds of torch present ROCm devices as ``cuda``)."""

    def __init__(self) -> None:
        super().__init__("cuda", "rocm" if torch.version.hip else "cuda", _cuda_capabilities)


class MpsBackend:
    """Apple silicon: one device sharing memory with the host."""

    name = "mps"

    def available(self) -> bool:
        mps = getattr(torch.backends, "mps", None)
        return bool(mps is not None and mps.is_available())

    def devices(self) -> list[DeviceInfo]:
        mps = torch.mps
        if hasattr(mps, "recommended_max_memory"):
            total = int(mps.recommended_max_memory())
        else:
            total = int(psutil.virtual_memory().total)
        allocated = int(mps.current_allocated_memory())
        reserved = int(mps.driver_allocated_memory())
        free = max(0, total - reserved)
        dtypes = _dtypes(True, True, False)
        return [DeviceInfo("", "mps", "Apple MPS", "mps", total, free, allocated, reserved, None, dtypes)]

    def reset_peaks(self) -> None:
        """MPS keeps no peak statistics."""


class DirectMLBackend:
    """DirectML on Windows (``torch-directml``); it cannot report memory, so figures stay unknown."""

    name = "directml"

    def available(self) -> bool:
        return _installed("torch_directml")

    def devices(self) -> list[DeviceInfo]:
        import torch_directml  # only present on DirectML installs

        found = []
        for index in range(torch_directml.device_count()):
            name = torch_directml.device_name(index)
            native = f"privateuseone:{index}"
            found.append(DeviceInfo("", "directml", name, native, None, None, dtypes=_dtypes(True, False, False)))
        return found

    def reset_peaks(self) -> None:
        """DirectML reports no memory figures at all."""


class CpuBackend:
    """The host: system RAM, with this process's resident set counted as 'used by this process'."""

    name = "cpu"

    def available(self) -> bool:
        return True

    def devices(self) -> list[DeviceInfo]:
        memory = psutil.virtual_memory()
        rss = this_process().memory_info().rss
        others = max(0, memory.total - memory.available - rss)
        name = f"CPU ({psutil.cpu_count(logical=True)} threads)"
        return [DeviceInfo("cpu", "cpu", name, "cpu", memory.total, memory.available, None, None, others)]

    def reset_peaks(self) -> None:
        """The host's figures are the system's; there is no allocator peak to reset."""


def default_backends() -> list[Backend]:
    """The probes, in the order their devices are numbered ``gpu:0``, ``gpu:1``, ..."""
    return [
        CudaBackend(),
        TorchModuleBackend("xpu", "xpu"),
        TorchModuleBackend("npu", "npu"),
        TorchModuleBackend("mlu", "mlu"),
        MpsBackend(),
        DirectMLBackend(),
        CpuBackend(),
    ]


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
