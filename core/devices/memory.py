"""Memory of one placement target right now: what is free, how big it is, and giving cached memory back.

The inventory (``core.devices``) describes every device for reports; the loading engine needs these three
questions answered fast, for the one device it is filling. Each backend answers for its own devices; memory
the backend's allocator holds in its cache counts as free: it is ours to reuse.
"""

from __future__ import annotations

import gc

from .backends import Target, backend_of


def free_bytes(target: Target) -> int:
    """Bytes a new allocation on ``target`` may take now (the allocator's cache included)."""
    return backend_of(target).free(target)


def capacity_bytes(target: Target) -> int:
    """The total memory of ``target``."""
    return backend_of(target).capacity(target)


def empty_cache(target: Target) -> None:
    """Give memory the allocator keeps cached on ``target`` back to the device (after a collection, so
    tensors that only cycles kept alive go too)."""
    gc.collect()
    backend_of(target).empty_cache(target)
