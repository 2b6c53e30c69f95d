"""Memory of one placement target right now: what is free, how big it is, and giving cached memory back.

The inventory (``core.devices``) describes every device for reports; the loading engine needs these three
questions answered fast, for the one device it is filling. Each backend answers for its own devices; memory
the backend's allocator holds in its cache counts as free: it is ours to reuse.

Running out of device memory is recognised by :func:`is_out_of_memory` alone: torch does not raise one class
for it. Its caching allocators raise ``torch.OutOfMemoryError``, but a failed call into the runtime itself
(a stream, a cuBLAS handle, an event made under memory pressure) raises ``torch.AcceleratorError`` ("CUDA
error: out of memory") on a recent torch and a plain ``RuntimeError`` on an older one or another backend.
"""

from __future__ import annotations

import gc

import torch

from .backends import Target, backend_of

#: Words (lower case) with which torch and the device runtimes under it say a device ran out of memory:
#: the caching allocators ("CUDA out of memory", "HIP out of memory", "XPU out of memory", "MPS backend out
#: of memory") and the runtimes' errors ("CUDA error: out of memory", "HIP error: out of memory"), the names of
#: those errors (``cudaErrorMemoryAllocation``, ``hipErrorOutOfMemory``), a CUDA library that could not
#: allocate its workspace or handle (``CUBLAS_STATUS_ALLOC_FAILED``, ``CUDNN_STATUS_ALLOC_FAILED``), oneAPI's
#: Level Zero (``UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY``) and DirectML ("not enough GPU video memory").
OUT_OF_MEMORY_WORDS = (
    "out of memory",
    "cudaerrormemoryallocation",
    "hiperroroutofmemory",
    "status_alloc_failed",
    "out_of_device_memory",
    "not enough gpu video memory",
)

#: The error code a ``torch.AcceleratorError`` carries for an allocation the runtime refused
#: (``cudaErrorMemoryAllocation`` and ``hipErrorOutOfMemory`` are both 2).
_RUNTIME_OUT_OF_MEMORY = 2


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says a device ran out of memory, whichever torch class carries it.

    Every place that survives running out of memory (the loading engine's guard, a split model's load, a
    fill that falls back to RAM) asks this, so that an out-of-memory raised by the runtime instead of the
    caching allocator is survived the same way instead of ending the run. ``torch.AcceleratorError`` is looked
    up by name, as a torch older than 2.8 does not have it (it raises a plain ``RuntimeError`` there)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    runtime_code = getattr(exc, "error_code", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error) and runtime_code == _RUNTIME_OUT_OF_MEMORY:
        return True
    text = str(exc).lower()
    return any(words in text for words in OUT_OF_MEMORY_WORDS)


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
