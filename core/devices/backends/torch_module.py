"""Devices torch drives through a CUDA-style module (``torch.cuda``, ``torch.xpu``, ``torch.npu``, ``torch.mlu``).

They share one API: device count and names, memory queries, an allocator cache, streams and events. What
differs between them (the dtypes a device computes in, pinning host memory) is left to the subclasses.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from .base import DeviceBackend, DeviceInfo, Target, describe, dtypes_from

log = logging.getLogger("device_control")


class TorchModuleBackend(DeviceBackend):
    """A backend exposed as ``torch.<module>`` with the CUDA-style API.

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
        self._streams: dict[torch.device, Any] = {}
        self._lock = threading.Lock()
        self._no_gauge: set[str] = set()  # gauges that raised once (no management library): not asked again

    def _torch_module(self) -> Any:
        return getattr(torch, self.module, None)

    # -- identity --------------------------------------------------------------------------------

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
            return DeviceInfo("", self.name, torch_device, torch_device, None, None, error=describe(exc))
        try:
            allocated = int(mod.memory_allocated(index))
            reserved = int(mod.memory_reserved(index))
            if hasattr(mod, "mem_get_info"):
                free, total = (int(v) for v in mod.mem_get_info(index))
            else:
                total = int(mod.get_device_properties(index).total_memory)
                free = total - reserved
            others = max(0, total - free - reserved)
            dtypes = dtypes_from(*self._capabilities(mod, index))
            peak = int(mod.max_memory_allocated(index)) if hasattr(mod, "max_memory_allocated") else None
        except Exception as exc:
            return DeviceInfo("", self.name, name, torch_device, None, None, error=describe(exc))
        info = DeviceInfo("", self.name, name, torch_device, total, free, allocated, reserved, others, dtypes)
        return replace(info, peak_allocated=peak, **self._gauges(mod, index))

    def _gauges(self, mod: Any, index: int) -> dict[str, int | None]:
        """The device's utilisation and temperature where the module reports them (``torch.cuda`` does through
        pynvml or amdsmi, and raises without them); ``None`` for each it cannot tell."""
        read: dict[str, int | None] = {}
        for gauge in ("utilization", "temperature"):
            read[gauge] = None
            if gauge in self._no_gauge or not callable(getattr(mod, gauge, None)):
                continue
            try:
                read[gauge] = int(getattr(mod, gauge)(index))
            except Exception as exc:  # no management library, or a driver that does not answer: not reported
                self._no_gauge.add(gauge)
                log.info("[Device Control] %s of %s devices not reported: %s", gauge, self.name, describe(exc))
        return read

    def reset_peaks(self) -> None:
        mod = self._torch_module()
        if hasattr(mod, "reset_peak_memory_stats"):
            for index in range(mod.device_count()):
                mod.reset_peak_memory_stats(index)

    # -- memory ----------------------------------------------------------------------------------

    def _free_and_total(self, target: Target) -> tuple[int, int]:
        mod = self._torch_module()
        if hasattr(mod, "mem_get_info"):
            free, total = mod.mem_get_info(target)
            cached = int(mod.memory_reserved(target)) - int(mod.memory_allocated(target))
            return int(free) + max(0, cached), int(total)
        total = int(mod.get_device_properties(target).total_memory)
        return total - int(mod.memory_allocated(target)), total

    def free(self, target: Target) -> int:
        return self._free_and_total(target)[0]

    def capacity(self, target: Target) -> int:
        return self._free_and_total(target)[1]

    def empty_cache(self, target: Target) -> None:
        mod = self._torch_module()
        if hasattr(mod, "empty_cache"):
            mod.empty_cache()

    # -- streams and events ----------------------------------------------------------------------

    def side_stream(self, target: Target) -> Any | None:
        mod = self._torch_module()
        if not hasattr(mod, "Stream"):
            return None
        with self._lock:
            if target not in self._streams:
                self._streams[target] = mod.Stream(device=target)
            return self._streams[target]

    def current_stream(self, target: Target) -> Any | None:
        mod = self._torch_module()
        return mod.current_stream(target) if hasattr(mod, "current_stream") else None

    def on_stream(self, stream: Any) -> Any:
        return self._torch_module().stream(stream)

    def record(self, stream: Any) -> Any | None:
        event = self._torch_module().Event()
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def synchronize(self, target: Target) -> None:
        self._torch_module().synchronize(target)

    def wait_host(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.is_pinned()
