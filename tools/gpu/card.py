"""The card a GPU benchmark runs on: a real CUDA GPU made small, or the pack's simulated GPU.

A user with a small card feels what ComfyUI and the pack do when a model does not fit. A benchmark machine has a
large GPU; :meth:`Card.hold` makes it small by allocating a block so that only so many bytes stay free, for
ComfyUI and the pack alike (both ask the driver what is free; the block counts as used), and :meth:`Card.release`
gives it back. The same interface drives the simulated GPU (``DEVICE_CONTROL_SIMULATE_GPU``), where the block is
the device's ``used_by_others``, so the benchmark runs end to end on a machine without a GPU (in CI, small).

Every figure excludes the block: what is allocated, and the peak since :meth:`Card.reset_peak`.
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from typing import Any

import torch

log = logging.getLogger("device_control")

GiB = 1024**3
MiB = 1024**2


class Card:
    """One GPU as the benchmark sees it (see the module docstring)."""

    #: What the card is, in words (the GPU's name, or the simulated device's).
    name: str = ""
    #: The device id the pack's nodes take (``gpu:0``).
    device_id: str = "gpu:0"

    def synchronize(self) -> None:
        """Wait until the device has done all it was asked (so a host clock measures the device's work)."""

    def hold(self, free: int) -> int:
        """Leave only ``free`` bytes free; return the bytes held back."""
        raise NotImplementedError

    def release(self) -> None:
        """Give back what :meth:`hold` took."""

    def allocated(self) -> int:
        """Bytes allocated on the device now, the block left out."""
        raise NotImplementedError

    def free(self) -> int:
        """Bytes free on the device now, as its driver (or books) say."""
        raise NotImplementedError

    def reset_peak(self) -> None:
        """Start measuring the peak allocation again."""

    def peak(self) -> int:
        """The most bytes allocated at once since :meth:`reset_peak`, the block left out."""
        raise NotImplementedError

    def peak_reserved(self) -> int | None:
        """The most bytes the device's caching allocator held at once since :meth:`reset_peak`, the block left out
        (its 2 MiB segments and the rounding the decode reserve must cover), or ``None`` where it keeps no cache."""
        return None

    def empty_cache(self) -> None:
        """Give memory the allocator keeps cached back to the device (between runs)."""
        gc.collect()

    def bandwidth(self) -> dict[str, float]:
        """Host-to-device copy speed in bytes per second: ``pinned`` (what streaming uses), ``pageable``."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """What the raw output records about the card."""
        return {"name": self.name, "device_id": self.device_id}


class CudaCard(Card):
    """A CUDA GPU (``cuda:0``), made small by a block of ``torch.uint8`` held on it."""

    def __init__(self) -> None:
        self.device = torch.device("cuda", 0)
        self.name = torch.cuda.get_device_name(self.device)
        self._block: torch.Tensor | None = None

    @property
    def held(self) -> int:
        return 0 if self._block is None else self._block.numel()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def hold(self, free: int) -> int:
        self.release()
        free_now, _total = torch.cuda.mem_get_info(self.device)
        size = max(0, free_now - free)
        if size:
            self._block = torch.empty(size, dtype=torch.uint8, device=self.device)
        log.info(
            "[Device Control] card: %.2f GiB held back, %.2f GiB free (asked for %.2f GiB)",
            size / GiB,
            self.free() / GiB,
            free / GiB,
        )
        return size

    def release(self) -> None:
        self._block = None
        self.empty_cache()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self.held

    def free(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def reset_peak(self) -> None:
        self.synchronize()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        self.synchronize()
        return torch.cuda.max_memory_allocated(self.device) - self.held

    def peak_reserved(self) -> int | None:
        self.synchronize()
        return torch.cuda.max_memory_reserved(self.device) - self.held

    def empty_cache(self) -> None:
        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def bandwidth(self, nbytes: int = GiB, repeats: int = 3) -> dict[str, float]:
        """Copy ``nbytes`` from pinned and from pageable host memory ``repeats`` times each; the median speeds."""
        speeds: dict[str, float] = {}
        target = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        for kind, pinned in (("pinned", True), ("pageable", False)):
            source = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
            target.copy_(source, non_blocking=pinned)  # warm-up: the first copy sets up the path
            self.synchronize()
            seconds = []
            for _ in range(repeats):
                started = time.perf_counter()
                target.copy_(source, non_blocking=pinned)
                self.synchronize()
                seconds.append(time.perf_counter() - started)
            speeds[kind] = nbytes / statistics.median(seconds)
            del source
        del target
        self.empty_cache()
        return speeds

    def describe(self) -> dict[str, Any]:
        properties = torch.cuda.get_device_properties(self.device)
        return {
            **super().describe(),
            "total_bytes": properties.total_memory,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
        }


class SimulatedCard(Card):
    """The pack's simulated GPU ``gpu:0`` (``DEVICE_CONTROL_SIMULATE_GPU``), driven through its backend.

    Args:
        device: the ``SimulatedDevice`` the pack's inventory resolves ``gpu:0`` to.
        backend: its backend (``core.devices.backends.backend_of(device)``): copies and synchronisation.
    """

    def __init__(self, device: Any, backend: Any) -> None:
        self.device = device
        self.backend = backend
        self.name = f"simulated GPU ({device!r})"

    def synchronize(self) -> None:
        self.backend.synchronize(self.device)

    def hold(self, free: int) -> int:
        size = max(0, self.device.capacity - self.device.allocated() - free)
        self.device.used_by_others = size  # what another program would hold: counted as used, never ours
        log.info("[Device Control] simulated card: %.2f GiB held back, %.2f GiB free", size / GiB, self.free() / GiB)
        return size

    def release(self) -> None:
        self.device.used_by_others = 0
        self.empty_cache()

    def allocated(self) -> int:
        return self.device.allocated()

    def free(self) -> int:
        return self.device.free()

    def reset_peak(self) -> None:
        self.synchronize()
        self.device.reset_peak()

    def peak(self) -> int:
        self.synchronize()
        return self.device.peak_allocated()

    def bandwidth(self, nbytes: int = 64 * MiB, repeats: int = 3) -> dict[str, float]:
        """The simulated link's speed, timed through the backend's own copy (its cost model decides it)."""
        source = torch.ones(nbytes, dtype=torch.uint8)
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            copy = self.backend.copy_to(source, self.device)
            self.synchronize()
            seconds.append(time.perf_counter() - started)
            self.backend.release(copy)
            del copy
        speed = nbytes / max(statistics.median(seconds), 1e-9)
        return {"pinned": speed, "pageable": speed}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "total_bytes": self.device.capacity, "torch": torch.__version__}
