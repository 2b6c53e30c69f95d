"""Staging buffers: how a group whose slab could not be page-locked still crosses without stopping the host.

A copy from pageable host memory is synchronous for the host on CUDA: the host waits for it, and the copy, on the
side stream, waits for the computation queued before it, so the host would stand still until the device caught up
at every group and nothing would overlap. Where a slab is not page-locked (the pinned-memory cap is reached, or the
driver refused), its group is first copied on the host into a small page-locked buffer of its slot (one per ring
slot, locked even past the pinned-memory cap: they are small), and crosses from there without the host waiting.
The host writes into a buffer only once the copy that last read it has ended (its event), so a queued copy never
reads memory the host is rewriting.
"""

from __future__ import annotations

import torch

from ..devices.backends import Target, backend_of
from ..devices.host_memory import page_block
from ..devices.pinned import pinned_memory


class Staging:
    """The page-locked buffers of one ring's slots, kept from one sampling call to the next."""

    def __init__(self) -> None:
        self._blocks: list[torch.Tensor] = []
        self._events: list[object | None] = []
        self._target: Target | None = None

    def prepare(self, target: Target, slots: int, nbytes: int) -> bool:
        """One page-locked buffer of ``nbytes`` per slot for copies to ``target`` (kept when they fit already);
        ``False`` when they cannot all be locked (the groups then cross as pageable memory, blocking the host)."""
        if self._target is target and len(self._blocks) >= slots and self._blocks[0].numel() >= nbytes:
            return True
        self.release()
        for _ in range(slots):
            with torch.inference_mode(False):  # a plain tensor, written in place whether or not in inference mode
                block = page_block(nbytes)
            if not pinned_memory().lock(block, target, capped=False):
                self.release()
                return False
            self._blocks.append(block)
        self._events = [None] * slots
        self._target = target
        return True

    @property
    def ready(self) -> bool:
        """Whether there are buffers to stage through."""
        return bool(self._blocks)

    def stage(self, slot: int, source: torch.Tensor) -> torch.Tensor:
        """``source`` (a slab) copied into ``slot``'s buffer on the host, once the copy that last read that buffer
        has ended: the range to copy to the device from."""
        backend = backend_of(self._target)
        backend.wait_host(self._events[slot])
        staged = self._blocks[slot].narrow(0, 0, source.numel())
        staged.copy_(source)
        return staged

    def used(self, slot: int, event: object | None) -> None:
        """The copy that reads ``slot``'s buffer ends with ``event``."""
        self._events[slot] = event

    def release(self) -> None:
        """Wait for the copies reading the buffers, then unlock and free them."""
        if self._target is not None:
            backend = backend_of(self._target)
            for event in self._events:
                backend.wait_host(event)
        for block in self._blocks:
            pinned_memory().unlock(block)
        self._blocks, self._events, self._target = [], [], None
