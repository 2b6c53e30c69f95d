"""Page-locked host memory: one registration API and one set of books for the whole process.

A copy from page-locked (pinned) host memory crosses to a device without the host waiting; from pageable memory
the host waits for it. Page-locking (CUDA's ``cudaHostRegister``) has rules the engine must never break, on any OS:

* **Whole pages.** Registration locks whole pages (``core.devices.host_memory.page_size``: 4 KiB on x86-64,
  16 KiB on Apple silicon, 64 KiB on some arm64 Linux), and a range that touches a page already registered fails.
  The books know every range registered here and ComfyUI's own (:func:`count_foreign_registrations`), so such a
  range is refused before the driver is asked.
* **A failed call leaves an error pending** that the next kernel raises as its own, until it is read back: it is
  read back right after every failed registration or unregistration (``take_error``); where a backend cannot read
  it back, nothing is registered (fail closed: copies block, and stay correct).
* **One cap** for ComfyUI's pinned bytes and ours (a share of RAM, default 45 %,
  ``DEVICE_CONTROL_MAX_PINNED_FRACTION``), never above what the driver allows (Windows: about half of RAM).

:meth:`PinnedMemory.lock` is the one way to pin: a ring's slab, a staging buffer, a block of LoRA factors, a
streamed layer's own weight or a file reader's staging buffer.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import weakref
from collections.abc import Callable, Mapping

import torch

from ..errors import InvalidSizeError
from .backends import Target, backend_of, label_of, target_of
from .host_memory import page_size, platform

log = logging.getLogger("device_control")

PINNED_FRACTION_ENV = "DEVICE_CONTROL_MAX_PINNED_FRACTION"
DEFAULT_PINNED_FRACTION = 0.45
_pinned_fraction = DEFAULT_PINNED_FRACTION

#: ComfyUI's registrations (data pointer -> bytes), read when a range is locked (set by the nodes).
_foreign: Callable[[], Mapping[int, int]] | None = None


def pinned_fraction_from_env(environ: Mapping[str, str] | None = None) -> float:
    """The share of physical RAM that may be pinned, from ``DEVICE_CONTROL_MAX_PINNED_FRACTION`` (default 0.45).

    Raises:
        InvalidSizeError: the value is not a number from 0 to 1 (the message shows how to write it).
    """
    text = (os.environ if environ is None else environ).get(PINNED_FRACTION_ENV, "").strip()
    if not text:
        return DEFAULT_PINNED_FRACTION
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:  # NaN fails too
        raise InvalidSizeError(
            f"{PINNED_FRACTION_ENV}={text!r} is not a share of RAM from 0 to 1; write it like "
            f"{PINNED_FRACTION_ENV}=0.45 (0 turns pinning off)."
        )
    return value


def use_pinned_fraction(fraction: float) -> None:
    """Cap pinned host memory at ``fraction`` of physical RAM from now on (the settings do this at start)."""
    global _pinned_fraction, _pinned
    _pinned_fraction = fraction
    if _pinned is not None and not _pinned.pinned_bytes:  # nothing pinned yet: the next account uses the new cap
        _pinned = None


def count_foreign_registrations(provider: Callable[[], Mapping[int, int]] | None) -> None:
    """Count the host ranges ``provider`` returns (data pointer -> bytes: ComfyUI's own pinned tensors) against the
    cap, and never register a range touching their pages; ``None`` stops counting them."""
    global _foreign
    _foreign = provider


def foreign_registrations() -> Mapping[int, int]:
    """The ranges registered by others (ComfyUI), as their provider reads them now; empty if it cannot."""
    if _foreign is None:
        return {}
    try:
        return dict(_foreign())
    except Exception as exc:  # another program's books must never stop a load
        log.debug("[Device Control] ComfyUI's pinned-memory books could not be read: %s", exc)
        return {}


def default_cap() -> int:
    """The configured share of RAM, never above what the platform's driver page-locks."""
    found = platform()
    cap = int(found.ram_bytes() * _pinned_fraction)
    driver = found.registration_cap()
    return cap if driver is None else min(cap, driver)


class PinnedMemory:
    """The process's page-locked host memory: what is registered, for which device, under one cap.

    Args:
        max_bytes: the cap; default the configured share of RAM within the driver's limit (:func:`default_cap`).
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = default_cap() if max_bytes is None else max_bytes
        #: Ranges registered: data pointer -> (bytes, the device they were locked for, the tensor's finalizer).
        self.blocks: dict[int, tuple[int, Target, weakref.finalize]] = {}
        self._starts: list[int] = []  # the registered pointers, sorted (a new range checks its neighbour)
        self.failed: set[str] = set()  # labels of devices whose pinning failed since the last retry
        self._unreadable: set[str] = set()  # labels of devices already logged as failing closed

    @property
    def pinned_bytes(self) -> int:
        """Bytes this pack has page-locked now."""
        return sum(size for size, *_rest in self.blocks.values())

    def foreign_bytes(self) -> int:
        """Bytes ComfyUI has page-locked now (counted against the same cap)."""
        return sum(foreign_registrations().values())

    def lock(self, tensor: torch.Tensor, target: Target, *, capped: bool = True) -> bool:
        """Page-lock ``tensor``'s bytes (host memory) in place for copies to ``target``, counted against the cap
        until :meth:`unlock` or until the tensor object is freed; ``False``, with nothing changed, where that
        cannot be done: the backend cannot pin or read a failure back, the cap is reached, a page of the range is
        registered already (by anyone), or registering failed since the last :meth:`retry` (copies from the
        tensor stay correct, and block the host). ``capped=False``: locked even past the cap (a ring's small
        staging buffers, what lets groups the cap left pageable cross without stopping the host); counted all
        the same."""
        pointer, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if pointer in self.blocks:
            return True
        backend = backend_of(target)
        if not self._may_register(target) or not backend_of(target_of(tensor)).is_host or nbytes == 0:
            return False
        if capped and self.pinned_bytes + self.foreign_bytes() + nbytes > self.max_bytes:
            return False
        if backend.is_pinned(tensor) or self._touches(pointer, nbytes):
            return False  # locking a page twice fails, and the runtime would report it at the next kernel
        if not backend.pin(pointer, nbytes):
            self.failed.add(label_of(target))
            log.info(
                "[Device Control] host memory could not be page-locked (%s); copies to %s will block",
                backend.take_error(),  # read back now: left pending, the next kernel would raise it as its own
                label_of(target),
            )
            return False
        # Unlocked when the tensor goes; a view that outlives it then copies as pageable memory: slower, correct.
        self.blocks[pointer] = (nbytes, target, weakref.finalize(tensor, self._release, pointer))
        bisect.insort(self._starts, pointer)
        return True

    def _may_register(self, target: Target) -> bool:
        backend, label = backend_of(target), label_of(target)
        if not backend.can_pin or label in self.failed:
            return False
        if backend.reads_errors():
            return True
        if label not in self._unreadable:
            self._unreadable.add(label)
            log.warning(
                "[Device Control] host memory is not page-locked for %s: a failed page-lock's error cannot be "
                "read back on this system, and left pending it would fail the next computation. Copies from RAM "
                "block the host (slower, correct); update torch or the GPU driver to get them back.",
                label,
            )
        return False

    def _touches(self, pointer: int, nbytes: int) -> bool:
        """Whether a page of the range lies in a range registered here or by ComfyUI."""
        page = page_size()
        first, last = pointer // page, (pointer + nbytes - 1) // page
        at = bisect.bisect_right(self._starts, last * page + page - 1)
        if at and self._last_page(self._starts[at - 1], page) >= first:
            return True
        return any(
            start // page <= last and (start + size - 1) // page >= first
            for start, size in foreign_registrations().items()
        )

    def _last_page(self, pointer: int, page: int) -> int:
        return (pointer + self.blocks[pointer][0] - 1) // page

    def unlock(self, tensor: torch.Tensor) -> None:
        """Undo :meth:`lock`: the memory stays, pageable (the weights in it keep living there)."""
        entry = self.blocks.get(tensor.data_ptr())
        if entry is not None:
            entry[2].detach()
            self._release(tensor.data_ptr())

    def _release(self, pointer: int) -> None:
        entry = self.blocks.pop(pointer, None)
        if entry is None:
            return
        self._starts.remove(pointer)
        backend = backend_of(entry[1])
        if not backend.unpin(pointer):
            log.warning(
                "[Device Control] host memory locked for %s could not be unlocked (%s)",
                label_of(entry[1]),
                backend.take_error(),  # read back: left pending, the next kernel would raise it as its own
            )

    def retry(self) -> None:
        """Try pinning again on devices where it failed (once per load: a failure under memory pressure, or for
        one range, must not turn pinning off for the rest of the process)."""
        self.failed.clear()


_pinned: PinnedMemory | None = None


def pinned_memory() -> PinnedMemory:
    """The process's pinned-memory books (one cap for every model, and for ComfyUI's own pinned bytes)."""
    global _pinned
    if _pinned is None:
        _pinned = PinnedMemory()
    return _pinned
