"""The host side of the simulated GPU: page-locked memory as CUDA registers it, the runtime error a failed call leaves
pending, and host memory that copies queued without the host waiting still read.

A real GPU fails on these where a simulated one that only books bytes would pass, and each failure was seen on a real
GPU first (an H100's tier raised "already mapped" from a forward after a failed registration), so the simulated GPU
fails the same way here, on a CPU machine, in every test:

* **Registration is page-granular** (:class:`HostRegistry`): a range is locked in whole pages of :data:`PAGE` bytes,
  and registering a range that touches a page already registered fails, like ``cudaHostRegister`` does.
* **A failed call's error stays pending** until it is read back (``cudaGetLastError``, the backend's
  ``take_error``): until then the next computation or copy on a simulated device raises it as its own, as torch's
  launch check reports CUDA's last error. It is kept per host thread, as CUDA keeps it.
* **A queued copy reads its source until the host knows it ended** (:class:`HostReads`): a copy from page-locked
  memory queued without the host waiting reads the host memory later, on a real GPU; the host must wait for its
  event (or for a stream that waited for it, or for the whole device) before it writes to that memory or frees it.
  Here the bytes are copied at once, so a write or a free in between would go unnoticed: instead a sample of the
  source is kept and compared when the host's wait comes, and a source freed before is a fault raised at the next
  operation on the device (a finalizer cannot raise).
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

#: The page size host registration works in (x86-64 and most ARM hosts).
PAGE = 4096

#: CUDA's text for a registration that overlaps a registered page (``cudaErrorHostMemoryAlreadyRegistered``).
ALREADY_MAPPED = "part or all of the requested memory range is already mapped"
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

    Ranges are kept sorted by their first page, so a registration checks its two neighbours only.
    """

    def __init__(self) -> None:
        self._starts: list[int] = []  # first page of each range, sorted
        self._ranges: dict[int, tuple[int, int]] = {}  # first page -> (pointer, bytes)
        self._lock = threading.Lock()
        self._local = threading.local()
        #: How many host threads have an error pending (read without a lock on every operation: a quick "none").
        self.pending = 0

    def register(self, pointer: int, size: int) -> bool:
        """Lock ``size`` bytes at ``pointer``; ``False``, with the error left pending, when a page of the range is
        registered already (or the range is empty)."""
        if size <= 0:
            self._fail("invalid argument")
            return False
        first, last = pointer // PAGE, (pointer + size - 1) // PAGE
        with self._lock:
            at = bisect.bisect_right(self._starts, last)
            if at and self._last_page(self._starts[at - 1]) >= first:
                overlaps = True
            else:
                overlaps = False
                self._starts.insert(at, first)
                self._ranges[first] = (pointer, size)
        if overlaps:
            self._fail(ALREADY_MAPPED)
        return not overlaps

    def unregister(self, pointer: int) -> None:
        """Unlock the range registered at ``pointer``; its pages may be registered again. A pointer that starts no
        range leaves an error pending, as CUDA does."""
        first = pointer // PAGE
        with self._lock:
            found = self._ranges.get(first, (None, 0))[0] == pointer
            if found:
                del self._ranges[first]
                self._starts.remove(first)
        if not found:
            self._fail(NOT_REGISTERED)

    def holds(self, pointer: int, nbytes: int) -> bool:
        """Whether the ``nbytes`` at ``pointer`` lie in one registered range (a copy from them needs no staging)."""
        with self._lock:
            at = bisect.bisect_right(self._starts, pointer // PAGE)
            if not at:
                return False
            start, size = self._ranges[self._starts[at - 1]]
        return start <= pointer and pointer + max(nbytes, 1) <= start + size

    def _last_page(self, first: int) -> int:
        pointer, size = self._ranges[first]
        return (pointer + size - 1) // PAGE

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

    def add(self, source: torch.Tensor, stream: Any, position: int) -> None:
        """A copy of ``source`` (host memory, contiguous) was queued at ``position`` of ``stream``."""
        storage = source.untyped_storage()
        offset = source.data_ptr() - storage.data_ptr()
        nbytes = source.numel() * source.element_size()
        read = _Read(stream, position, weakref.ref(storage), offset, nbytes, _sample(storage, offset, nbytes))
        read.finalizer = weakref.finalize(storage, self._freed, read)
        self._reads.append(read)

    def _freed(self, read: _Read) -> None:
        read.freed = True
        self._faults.append(
            f"{self.label}: host memory a queued copy still read was freed before the host waited for the copy "
            "(wait for the copy's event on the host before freeing or unlocking its source)"
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


def _sample(storage: torch.UntypedStorage, offset: int, nbytes: int) -> torch.Tensor:
    """Every :data:`SAMPLE_STRIDE`-th byte of ``nbytes`` of ``storage`` at ``offset`` (a copy)."""
    data = torch.empty(0, dtype=torch.uint8).set_(storage, offset, (nbytes,), (1,))
    return data[::SAMPLE_STRIDE].clone()
