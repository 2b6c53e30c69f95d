"""The host: system RAM, where a model is resident in full and nothing streams."""

from __future__ import annotations

import psutil

from .base import DeviceBackend, DeviceInfo, Target, this_process


class CpuBackend(DeviceBackend):
    """The host, with this process's resident set counted as 'used by this process'."""

    name = "cpu"
    is_host = True

    def available(self) -> bool:
        return True

    def devices(self) -> list[DeviceInfo]:
        memory = psutil.virtual_memory()
        rss = this_process().memory_info().rss
        others = max(0, memory.total - memory.available - rss)
        name = f"CPU ({psutil.cpu_count(logical=True)} threads)"
        return [DeviceInfo("cpu", "cpu", name, "cpu", memory.total, memory.available, None, None, others)]

    def free(self, target: Target) -> int:
        return int(psutil.virtual_memory().available)

    def capacity(self, target: Target) -> int:
        return int(psutil.virtual_memory().total)
