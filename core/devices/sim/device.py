"""A simulated GPU for machines that have none.

``SimulatedDevice`` keeps tensors in host memory but behaves, where it matters for memory management, like a real
accelerator:

* it has a capacity and exact residency books: every live tensor placed on it (and every tensor an operation on it
  produces) counts until the last Python reference to it is gone, in its bytes (``allocated``, against which the
  capacity holds) and in the blocks a caching allocator would give it (``reserved``: ``core.devices.allocator``),
  the figure a room kept for temporaries is held against;
* going over capacity raises ``torch.OutOfMemoryError``, the same exception a CUDA allocator raises;
* computing with a tensor on it and a *weight* that was never moved to it raises the same ``RuntimeError``
  ("Expected all tensors to be on the same device ...") a real device mismatch raises, so a forgotten move fails in
  tests instead of passing silently. A weight is an ``nn.Parameter``; one that is deliberately left in host memory
  and cast to the device for each use (a streamed layer) is marked with :func:`mark_streamed` and allowed.

Other host tensors met by an operation on the device (sampler noise, timesteps, a cast copy of a streamed weight)
count as uploaded inputs: on a real GPU the host application creates them on the device, which it cannot do for a
device torch does not know. Results of such operations are on the device.

Tensors on the device are instances of :class:`SimTensor`, a ``torch.Tensor`` subclass that shares storage with the
host tensor it was made from (a move costs no host memory). Moving back with :meth:`SimulatedDevice.to_host`,
``.cpu()`` or ``.to("cpu")`` returns a plain tensor.

Every move crosses the device's :class:`~core.devices.sim.link.Link`: it is counted there, takes the time the link's
cost says (none by default), and a copy queued on the side stream carries its stream position until a wait makes it
usable on the main stream. The device fails where CUDA fails (``core.devices.sim.host``). It is driven through its
backend (``core.devices.backends.simulated``), like any other.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Iterable

import torch

from ...units import format_bytes
from ..allocator import block_bytes
from .cost import LinkCost
from .host import REGISTRY
from .link import Link
from .slots import Slots
from .tensor import SimTensor, own_storage

#: A fault's placement or release takes this long (``slow_moves``, ``core.devices.sim.spec.KNOWN_FAULTS``).
SLOW_MOVE_SECONDS = 0.005


class _Entry:
    """Books for one storage on the device: its size, the block it takes, and how many live SimTensors use it."""

    __slots__ = ("block", "nbytes", "refs")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.block = block_bytes(nbytes)
        self.refs = 0


class SimulatedDevice:
    """A GPU stand-in with a capacity, residency books and real out-of-memory behaviour.

    Args:
        capacity: total bytes the device holds.
        ordinal: index among simulated devices; the device calls itself ``sim:<ordinal>`` in errors.
        used_by_others: bytes another process is pretending to hold (lowers what is free).
        faults: names from ``core.devices.sim.spec.KNOWN_FAULTS`` to inject, for fault-tolerance tests.
        link: what a copy to or from the device costs (default: nothing).
    """

    kind = "simulated"

    def __init__(
        self,
        capacity: int,
        *,
        ordinal: int = 0,
        used_by_others: int = 0,
        faults: Iterable[str] = (),
        link: LinkCost | None = None,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"a simulated device needs a positive capacity, not {capacity}.")
        self.capacity = int(capacity)
        self.ordinal = ordinal
        self.used_by_others = int(used_by_others)
        self.faults = frozenset(faults)
        self._books: dict[int, _Entry] = {}
        self._released: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._allocated = 0
        self._peak = 0
        self._reserved = 0
        self._peak_reserved = 0
        self._lock = threading.Lock()
        self._fail_after: int | None = None
        self.link = Link(link or LinkCost())
        self.link.reads.label = self.label
        #: Device buffers filled by :meth:`copy_into` (a streaming ring's slots), checked as a real device orders them.
        self.slots = Slots(self.link, self.label)

    @property
    def label(self) -> str:
        """The name used in error messages, in the style of ``cuda:0``."""
        return f"sim:{self.ordinal}"

    @property
    def name(self) -> str:
        """A human-readable name for reports."""
        return f"Simulated GPU {self.ordinal} ({format_bytes(self.capacity)})"

    def fail_allocation(self, after: int) -> None:
        """Inject one out-of-memory error: the allocation after the next ``after`` ones fails, whatever is free.

        For fault tests that need an OOM at a chosen point of a move (its first, middle or last layer); the
        fault fires once, then the device behaves normally again.
        """
        if after < 0:
            raise ValueError(f"after must be 0 or more, not {after}.")
        with self._lock:
            self._fail_after = after

    # -- books -------------------------------------------------------------------------------------

    def allocated(self) -> int:
        """Bytes currently held by live tensors on this device."""
        with self._lock:
            self._settle()
            return self._allocated

    def peak_allocated(self) -> int:
        """The most bytes held at once since creation or the last :meth:`reset_peak`."""
        return self._peak

    def reserved(self) -> int:
        """Bytes the live tensors take in a caching allocator's blocks (``core.devices.allocator``)."""
        with self._lock:
            self._settle()
            return self._reserved

    def peak_reserved(self) -> int:
        """The most bytes held at once in blocks since creation or the last :meth:`reset_peak`."""
        return self._peak_reserved

    def reset_peak(self) -> None:
        """Start measuring both peaks again from the current allocation."""
        with self._lock:
            self._settle()
            self._peak, self._peak_reserved = self._allocated, self._reserved

    def free(self) -> int:
        """Bytes that a new allocation may still take, as far as the device reports."""
        with self._lock:
            self._settle()
            return self._reported_free()

    def _free(self) -> int:  # with the lock held: what an allocation can really take
        return max(0, self.capacity - self.used_by_others - self._allocated)

    def _reported_free(self) -> int:  # with the lock held
        if "unreported_others" in self.faults:
            return max(0, self.capacity - self._allocated)
        return self._free()

    def stats(self) -> dict[str, int]:
        """Memory figures in the shape the device inventory reports for real backends.

        Raises:
            RuntimeError: when the ``stats`` fault is injected (as a failing driver query would).
        """
        if "stats" in self.faults:
            raise RuntimeError(f"{self.label}: injected fault: memory statistics query failed")
        with self._lock:
            self._settle()
            return {
                "total": self.capacity,
                "free": self._reported_free(),
                "torch_allocated": self._allocated,
                "torch_reserved": self._reserved,
                "used_by_others": 0 if "unreported_others" in self.faults else self.used_by_others,
                "peak_allocated": self._peak,
            }

    def _register(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage (once per storage) and tie its release to the tensor's life."""
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        key = storage.data_ptr()
        with self._lock:
            self._settle()
            entry = self._books.get(key)
            if entry is None:
                if self._fail_after == 0:
                    self._fail_after = None
                    raise torch.OutOfMemoryError(f"injected fault: {self._oom_message(nbytes)}")
                if nbytes > self._free():
                    raise torch.OutOfMemoryError(self._oom_message(nbytes))
                if self._fail_after is not None:
                    self._fail_after -= 1
                entry = _Entry(nbytes)
                self._books[key] = entry
                self._allocated += nbytes
                self._reserved += entry.block
                self._peak = max(self._peak, self._allocated)
                self._peak_reserved = max(self._peak_reserved, self._reserved)
            entry.refs += 1
        tensor._sim_release = weakref.finalize(tensor, self._drop, key)

    def _drop(self, key: int) -> None:
        # A finalizer: it may run in any thread, and inside _register when the garbage collector strikes there,
        # so it takes no lock; the release is queued and settled under the lock by the next reader of the books.
        self._released.put(key)

    def _settle(self) -> None:
        """Apply queued releases (called with the lock held)."""
        while True:
            try:
                key = self._released.get_nowait()
            except queue.Empty:
                return
            entry = self._books.get(key)
            if entry is not None:
                entry.refs -= 1
                if entry.refs <= 0:
                    del self._books[key]
                    self._allocated -= entry.nbytes
                    self._reserved -= entry.block
                    self.slots.forget(key)

    def _oom_message(self, nbytes: int) -> str:
        return (
            f"Simulated device {self.label} out of memory. Tried to allocate {format_bytes(nbytes)}. "
            f"It has a total capacity of {format_bytes(self.capacity)} of which {format_bytes(self._free())} "
            f"is free; {format_bytes(self._allocated)} is allocated by this process."
        )

    # -- moves -------------------------------------------------------------------------------------

    def raise_pending(self) -> None:
        """Raise what a computation or a copy on this device reports before its own work, as CUDA's launch check
        does: a failed host registration's error nobody read back (``PendingDeviceError``, cleared by raising), or
        host memory freed while a queued copy still read it (``MissingWaitError``): ``core.devices.sim.host``."""
        if REGISTRY.pending:
            REGISTRY.raise_pending(self.label)
        self.link.reads.raise_faults()

    def _here(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is on this device already (after raising what is pending); raise if on another."""
        self.raise_pending()
        if isinstance(tensor, SimTensor) and tensor.sim_device is not self:
            raise RuntimeError(
                f"tensor is on {tensor.sim_device.label}; move it to the host before placing it on {self.label}."
            )
        return isinstance(tensor, SimTensor)

    def place(self, tensor: torch.Tensor, *, host_waits: bool = True, pinned: bool = True) -> SimTensor:
        """Move ``tensor`` onto this device (the books count it; the host data is shared, not copied): a copy queued
        on the link's current stream, which the host waits for when ``host_waits`` or when it is not ``pinned``.

        Raises:
            torch.OutOfMemoryError: the tensor does not fit in what is free.
            RuntimeError: the tensor is already on another simulated device.
        """
        if self._here(tensor):
            return tensor
        if "slow_moves" in self.faults:
            time.sleep(SLOW_MOVE_SECONDS)
        with torch._C.DisableTorchFunctionSubclass():
            placed = tensor.detach().as_subclass(SimTensor)
            placed._sim_device = self
            self._register(placed)
        pending = self.link.copy(_nbytes(tensor), "to_device", host_waits=host_waits, pinned=pinned)
        if pending is not None:
            placed._sim_pending = pending
        return placed

    def copy_into(self, destination: SimTensor, source: torch.Tensor, *, pinned: bool, host_waits: bool) -> None:
        """Copy ``source`` (host memory) into ``destination``, a buffer on this device (a ring's slot, checked:
        ``core.devices.sim.slots``), on the link's current stream: the bytes really move, and the link charges the
        copy. One the host does not wait for (from ``pinned`` memory) reads ``source`` until the host waits for it
        (:attr:`Link.reads`).

        Raises:
            MissingWaitError: the copy would overwrite what a computation on the main stream read, unwaited.
        """
        self.raise_pending()
        key = destination.untyped_storage().data_ptr()
        self.slots.before_fill(key)
        with torch._C.DisableTorchFunctionSubclass():
            destination.as_subclass(torch.Tensor).copy_(source)
        stream = self.link.current
        self.slots.filled[key] = self.link.copy(_nbytes(source), "to_device", host_waits=host_waits, pinned=pinned)
        if pinned and not host_waits and source.is_contiguous():
            self.link.reads.add(source, stream, stream.queued)

    def check_landing(self, tensor: SimTensor) -> None:
        """A computation reads ``tensor``: checked if it lies in a buffer :meth:`copy_into` fills (``Slots.read``)."""
        self.slots.read(tensor.untyped_storage().data_ptr())

    def place_in_place(self, tensor: torch.Tensor) -> None:
        """Move a host tensor (a parameter, typically) onto this device keeping its identity, as
        ``Module.to`` keeps a parameter's: the object becomes a :class:`SimTensor` and the books count it. A view
        of a larger host block (a weight packed in a slab) is booked for its own bytes, as a real device allocates
        them, not for the block's.

        Raises:
            torch.OutOfMemoryError: it does not fit (the tensor is left as it was).
            RuntimeError: it is on another simulated device.
        """
        if self._here(tensor):
            return
        if "slow_moves" in self.faults:
            time.sleep(SLOW_MOVE_SECONDS)
        original, data = tensor.__class__, tensor.data
        tensor.data = own_storage(data)
        with torch._C.DisableTorchFunctionSubclass():
            tensor.__class__ = SimTensor
            tensor._sim_device = self
            tensor._sim_class = original  # given back when it leaves, as a real device keeps a parameter's class
            if issubclass(original, torch.nn.Parameter):
                tensor._is_param = True
            try:
                self._register(tensor)
            except BaseException:
                tensor.__class__ = original
                del tensor._sim_device
                tensor.data = data
                raise
        self.link.copy(_nbytes(tensor), "to_device", host_waits=True)

    def release(self, tensor: torch.Tensor) -> torch.Tensor:
        """Move ``tensor`` off this device, sharing its host data (no copy): for callers that drop the device
        tensor right away, as a weight moved back to RAM is. The books count it until that last reference goes.
        """
        if not isinstance(tensor, SimTensor):
            return tensor
        self.raise_pending()
        if "slow_moves" in self.faults:
            time.sleep(SLOW_MOVE_SECONDS)
        self.link.copy(_nbytes(tensor), "to_host", host_waits=True)
        with torch._C.DisableTorchFunctionSubclass():
            return tensor.detach().as_subclass(torch.Tensor)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return a plain host tensor with the data of ``tensor`` (a copy, as a device-to-host move is)."""
        if not isinstance(tensor, SimTensor):
            return tensor
        self.raise_pending()
        self.link.copy(_nbytes(tensor), "to_host", host_waits=True)
        with torch._C.DisableTorchFunctionSubclass():
            return tensor.as_subclass(torch.Tensor).clone()

    def __repr__(self) -> str:
        return (
            f"SimulatedDevice({self.label}, capacity={format_bytes(self.capacity)}, "
            f"allocated={format_bytes(self._allocated)})"
        )


def _nbytes(tensor: torch.Tensor) -> int:
    """The bytes a copy of ``tensor`` moves (its elements, as a real copy of a view moves)."""
    return tensor.numel() * tensor.element_size()
