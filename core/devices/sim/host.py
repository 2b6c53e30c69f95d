"""The host side of the simulated GPU: page-locked memory as CUDA registers it, the runtime error a failed call leaves
pending, and host memory that copies queued without the host waiting still read.

A real GPU fails on these where a simulated one that only books bytes would pass, and each failure was seen on a real
GPU first (an H100's tier raised "already mapped" from a forward after a failed registration), so the simulated GPU
fails the same way here, on a CPU machine, in every test:

* **Registration is page-granular** (:class:`HostRegistry`): a range is locked in whole pages of the platform's
  page size, and registering a range that touches a page already registered fails, like ``cudaHostRegister`` does;
  past the platform driver's limit (Windows: about half of RAM) it fails for want of memory.
* **A failed call's error stays pending** until it is read back (``cudaGetLastError``, the backend's
  ``take_error``): until then the next computation or copy on a simulated device raises it as its own, as torch's
  launch check reports CUDA's last error. It is kept per host thread, as CUDA keeps it.
* **A queued copy reads its source until the host knows it ended** (:class:`HostReads`): a copy from page-locked
  memory queued without the host waiting reads the host memory later, on a real GPU; the host must wait for its
  event (or for a stream that waited for it, or for the whole device) before it writes to that memory or frees it.
  Here the bytes are copied at once, so a write or a free in between would go unnoticed: instead a sample of the
  source is kept and compared when the host's wait comes, and a source freed or unlocked (unregistered) before is
  a fault raised at the next operation on the device (a finalizer cannot raise). Every copy the host does not wait
  for is booked, whichever path queued it: a ring's slot fill, a tensor moved on its own, a LoRA factor.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..host_memory import page_size, platform

#: CUDA's text for a registration that overlaps a registered page (``cudaErrorHostMemoryAlreadyRegistered``).
ALREADY_MAPPED = "part or all of the requested memory range is already mapped"
#: CUDA's text for a registration the driver refuses for want of memory (Windows past about half of RAM).
OUT_OF_MEMORY = "out of memory"
#: The text of a registration a device of unified memory cannot make (``cudaErrorNotSupported``'s).
NOT_SUPPORTED = "operation not supported"
#: CUDA's text for unregistering what was never registered (``cudaErrorHostMemoryNotRegistered``).
NOT_REGISTERED = "pointer does not correspond to a registered memory region"

#: A byte of a queued copy's source is sampled every this many bytes (a prime, so that the samples fall on every
#: byte of an element in turn, and every tensor packed 256 bytes apart gets some).
SAMPLE_STRIDE = 257


class MissingWaitError(RuntimeError):
    """Work on the device, or the host, used memory before the copy that writes or reads it was waited for."""


class PendingDeviceError(RuntimeError):
    """An error a failed runtime call left pending, raised by the next operation on the device (as CUDA's is)."""


class HostRegistry:
    """The host ranges registered (page-locked) for the simulated GPUs: one for the process, as CUDA's is.

    Ranges are kept sorted by where they start, so a registration checks one neighbour only. Pages are the
    platform's (``core.devices.host_memory``: 4 KiB, 16 KiB on Apple silicon, 64 KiB on some arm64 Linux), and
    where the platform's driver page-locks no more than a share of RAM (Windows: about half), a registration past
    it fails as CUDA's does there.
    """

    def __init__(self) -> None:
        self._starts: list[int] = []  # each range's pointer, sorted
        self._ranges: dict[int, int] = {}  # pointer -> bytes
        self._bytes = 0
        self._lock = threading.Lock()
        self._local = threading.local()
        #: How many host threads have an error pending (read without a lock on every operation: a quick "none").
        self.pending = 0

    def register(self, pointer: int, size: int) -> bool:
        """Lock ``size`` bytes at ``pointer``; ``False``, with the error left pending, when a page of the range is
        registered already, the driver's limit would be passed, or the range is empty."""
        with self._lock:
            refusal = self._refusal(pointer, size)
            if refusal is None:
                bisect.insort(self._starts, pointer)
                self._ranges[pointer] = size
                self._bytes += size
        if refusal is not None:
            self._fail(refusal)
        return refusal is None

    def _refusal(self, pointer: int, size: int) -> str | None:
        """CUDA's error for registering the range now, or ``None`` when it may be (under the lock)."""
        if size <= 0:
            return "invalid argument"
        page, cap = page_size(), platform().registration_cap()
        first, last = pointer // page, (pointer + size - 1) // page
        at = bisect.bisect_right(self._starts, last * page + page - 1)
        if at and (self._starts[at - 1] + self._ranges[self._starts[at - 1]] - 1) // page >= first:
            return ALREADY_MAPPED
        if cap is not None and self._bytes + size > cap:
            return OUT_OF_MEMORY
        return None

    def unregister(self, pointer: int) -> bool:
        """Unlock the range registered at ``pointer``; its pages may be registered again. A pointer that starts no
        range leaves an error pending, as CUDA does, and gives ``False``. A copy still queued from the range is a
        fault of the device it was queued on (:meth:`HostReads.unlocked`)."""
        with self._lock:
            size = self._ranges.pop(pointer, None)
            if size is not None:
                self._starts.remove(pointer)
                self._bytes -= size
        if size is None:
            self._fail(NOT_REGISTERED)
            return False
        for reads in list(_EVERY_READS):
            reads.unlocked(pointer, size)
        return True

    def holds(self, pointer: int, nbytes: int) -> bool:
        """Whether the ``nbytes`` at ``pointer`` lie in one registered range (a copy from them needs no staging)."""
        with self._lock:
            at = bisect.bisect_right(self._starts, pointer)
            if not at:
                return False
            start = self._starts[at - 1]
            size = self._ranges[start]
        return pointer + max(nbytes, 1) <= start + size

    def refuse(self, message: str) -> None:
        """Leave ``message`` pending as a refused call's error (a device that cannot register at all)."""
        self._fail(message)

    def _fail(self, message: str) -> None:
        with self._lock:
            if getattr(self._local, "error", None) is None:
                self.pending += 1
            self._local.error = message

    def take_error(self) -> str | None:
        """Read and clear this thread's pending error (``cudaGetLastError``); ``None`` when there is none."""
        error = getattr(self._local, "error", None)
        if error is not None:
            with self._lock:
                self._local.error = None
                self.pending -= 1
        return error

    def raise_pending(self, label: str) -> None:
        """Raise this thread's pending error, clearing it, as the next operation on a device reports it."""
        error = self.take_error() if self.pending else None
        if error is not None:
            raise PendingDeviceError(
                f"CUDA error: {error} (on {label}: an earlier host registration failed and its error was not read "
                "back; call the backend's take_error() right after a failed pin)"
            )


#: The process's registrations.
REGISTRY = HostRegistry()


@dataclass(eq=False)
class _Read:
    """One queued copy's source: where it is, a sample of its bytes then, and whether it was freed since."""

    stream: Any
    position: int
    storage: weakref.ref
    pointer: int
    offset: int
    nbytes: int
    sample: torch.Tensor
    freed: bool = False
    finalizer: weakref.finalize | None = field(default=None, repr=False)


class HostReads:
    """The host memory that copies queued on one simulated device still read, until the host waits for them."""

    def __init__(self, label: str = "") -> None:
        self.label = label
        self._reads: list[_Read] = []
        self._faults: deque[str] = deque()  # appended to by finalizers, in any thread
        _EVERY_READS.add(self)

    def add(self, source: torch.Tensor, stream: Any, position: int) -> None:
        """A copy of ``source`` (host memory, contiguous) was queued at ``position`` of ``stream``."""
        storage = source.untyped_storage()
        offset = source.data_ptr() - storage.data_ptr()
        nbytes = source.numel() * source.element_size()
        sample = _sample(storage, offset, nbytes)
        read = _Read(stream, position, weakref.ref(storage), source.data_ptr(), offset, nbytes, sample)
        read.finalizer = weakref.finalize(storage, self._freed, read)
        self._reads.append(read)

    def _freed(self, read: _Read) -> None:
        read.freed = True
        self._faults.append(
            f"{self.label}: host memory a queued copy still read was freed before the host waited for the copy "
            "(wait for the copy's event on the host before freeing or unlocking its source)"
        )

    def unlocked(self, pointer: int, size: int) -> None:
        """The ``size`` bytes at ``pointer`` were unlocked: a fault if a copy queued here still reads from them (on
        a real GPU the copy engine reads pages the OS may now move)."""
        reads = (read for read in self._reads if not read.freed)  # a freed source was reported as such
        if any(read.pointer < pointer + size and pointer < read.pointer + read.nbytes for read in reads):
            self._faults.append(
                f"{self.label}: host memory a queued copy still read was unlocked before the host waited for the "
                "copy (wait for the copy's event on the host before unlocking its source)"
            )

    def retire(self, done: Callable[[Any, int], bool]) -> None:
        """The host now knows the copies ``done`` names ended: forget their sources, after checking that none was
        written to while they were queued.

        Raises:
            MissingWaitError: the host wrote to a source before it waited for the copy reading it.
        """
        if not self._reads:
            return
        kept, ended = [], []
        for read in self._reads:
            (ended if done(read.stream, read.position) else kept).append(read)
        self._reads = kept
        written = False
        for read in ended:
            read.finalizer.detach()
            storage = read.storage()
            if not read.freed and storage is not None:
                written |= not torch.equal(_sample(storage, read.offset, read.nbytes), read.sample)
        if written:
            raise MissingWaitError(
                f"{self.label}: the host wrote to host memory a queued copy still read, before it waited for the "
                "copy (on a real GPU the copy may read the new bytes: wait for its event on the host first)"
            )

    def retire_all(self) -> None:
        """The host waited for the whole device."""
        self.retire(lambda _stream, _position: True)

    def raise_faults(self) -> None:
        """Raise the first fault a finalizer found (a freed source), forgetting them all."""
        if self._faults:
            first = self._faults[0]
            self._faults.clear()
            raise MissingWaitError(first)


#: Every device's :class:`HostReads`, for the process's registry to tell of an unlocked range.
_EVERY_READS: weakref.WeakSet[HostReads] = weakref.WeakSet()


def _sample(storage: torch.UntypedStorage, offset: int, nbytes: int) -> torch.Tensor:
    """Every :data:`SAMPLE_STRIDE`-th byte of ``nbytes`` of ``storage`` at ``offset`` (a copy)."""
    data = torch.empty(0, dtype=torch.uint8).set_(storage, offset, (nbytes,), (1,))
    return data[::SAMPLE_STRIDE].clone()
