"""Staging buffers: how a group whose slab could not be page-locked still crosses without stopping the host.

A copy from pageable host memory is synchronous for the host on CUDA: the host waits for it, and the copy, on the
side stream, waits for the computation queued before it, so the host would stand still until the device caught up
at every group and nothing would overlap. Where a slab is not page-locked (the pinned-memory cap is reached, or the
driver refused), its group is first copied on the host into a page-locked staging buffer (locked even past the
pinned-memory cap: there are few), and crosses from there without the host waiting.

The host writes into a buffer only once the copy that last read it has ended (its event), so a queued copy never
reads memory the host is rewriting. That copy followed the computations before its slot was free, so the buffers
bound how far the host runs ahead of the device: with one per slot, two groups, and a device with little queued
went idle while the host copied the next group on the host. The buffers are a pool of their own, used in turn:
enough to hold :data:`STAGING_AHEAD_BYTES` of groups ahead (at most :data:`STAGING_BUFFERS`, at least one per
slot, never more than the ring has groups). The copy on the host stays the host's work, as it is for CUDA's own
pageable copies (whose driver copies into its buffers while the host waits); what the pool buys is that the device
has queued work while the host does it.
"""

from __future__ import annotations

import torch

from ..devices.backends import Target, backend_of
from ..devices.host_memory import page_block
from ..devices.pinned import pinned_memory

#: Bytes of groups the host may have staged ahead of the copy it waits for (about 2.5 ms of a PCIe 4 link).
STAGING_AHEAD_BYTES = 64 * 1024**2
#: The most staging buffers a ring keeps (each locked on its own: small groups at budget 0 stop here).
STAGING_BUFFERS = 16


def pool_size(slots: int, groups: int, nbytes: int) -> int:
    """How many buffers of ``nbytes`` stage a ring of ``slots`` slots and ``groups`` groups (see the module)."""
    wanted = min(STAGING_BUFFERS, -(-STAGING_AHEAD_BYTES // max(nbytes, 1)), groups)
    return max(slots, wanted)


class Staging:
    """The page-locked buffers of one ring, used in turn, kept from one sampling call to the next."""

    def __init__(self) -> None:
        self._blocks: list[torch.Tensor] = []
        self._events: list[object | None] = []
        self._target: Target | None = None
        self._turn = 0  # the buffer the next group is staged in

    def prepare(self, target: Target, buffers: int, nbytes: int) -> bool:
        """``buffers`` page-locked buffers of ``nbytes`` for copies to ``target`` (kept when they fit already);
        ``False`` when they cannot all be locked (the groups then cross as pageable memory, blocking the host)."""
        if self._target is target and len(self._blocks) == buffers and self._blocks[0].numel() >= nbytes:
            return True
        self.release()
        for _ in range(buffers):
            with torch.inference_mode(False):  # a plain tensor, written in place whether or not in inference mode
                block = page_block(nbytes)
            if not pinned_memory().lock(block, target, capped=False):
                self.release()
                return False
            self._blocks.append(block)
        self._events = [None] * buffers
        self._target, self._turn = target, 0
        return True

    @property
    def ready(self) -> bool:
        """Whether there are buffers to stage through."""
        return bool(self._blocks)

    def stage(self, source: torch.Tensor) -> torch.Tensor:
        """``source`` (a slab's range) copied on the host into the next buffer in turn, once the copy that last
        read that buffer has ended: the range to copy to the device from (:meth:`used` says when that ends)."""
        self._turn = (self._turn + 1) % len(self._blocks)
        backend_of(self._target).wait_host(self._events[self._turn])
        staged = self._blocks[self._turn].narrow(0, 0, source.numel())
        staged.copy_(source)
        return staged

    def used(self, event: object | None) -> None:
        """The copy that reads the buffer last staged in ends with ``event``."""
        self._events[self._turn] = event

    def release(self) -> None:
        """Wait for the copies reading the buffers, then unlock and free them."""
        if self._target is not None:
            backend = backend_of(self._target)
            for event in self._events:
                backend.wait_host(event)
        for block in self._blocks:
            pinned_memory().unlock(block)
        self._blocks, self._events, self._target = [], [], None
