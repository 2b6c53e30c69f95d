"""Apple silicon: one device sharing memory with the host, with no streams torch exposes."""

from __future__ import annotations

import psutil
import torch

from .base import DeviceBackend, DeviceInfo, Target, dtypes_from


class MpsBackend(DeviceBackend):
    """The ``mps`` device; its memory is the host's, up to what Metal recommends for one process."""

    name = "mps"

    def available(self) -> bool:
        mps = getattr(torch.backends, "mps", None)
        return bool(mps is not None and mps.is_available())

    def devices(self) -> list[DeviceInfo]:
        total = self.capacity(torch.device("mps"))
        allocated = int(torch.mps.current_allocated_memory())
        reserved = int(torch.mps.driver_allocated_memory())
        free = max(0, total - reserved)
        dtypes = dtypes_from(True, True, False)
        return [DeviceInfo("", "mps", "Apple MPS", "mps", total, free, allocated, reserved, None, dtypes)]

    def capacity(self, target: Target) -> int:
        if hasattr(torch.mps, "recommended_max_memory"):
            return int(torch.mps.recommended_max_memory())
        return int(psutil.virtual_memory().total)  # older torch: the host's memory is the bound

    def free(self, target: Target) -> int:
        return max(0, self.capacity(target) - int(torch.mps.driver_allocated_memory()))

    def empty_cache(self, target: Target) -> None:
        torch.mps.empty_cache()

    def synchronize(self, target: Target) -> None:
        torch.mps.synchronize()
