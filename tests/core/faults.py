"""Out-of-memory errors as each torch class and device runtime words them, and a simulated GPU that raises one.

torch does not raise one class when a device runs out of memory: its caching allocators raise
``torch.OutOfMemoryError``, a runtime call made under memory pressure (a CUDA stream, a cuBLAS handle) raises
``torch.AcceleratorError`` on torch 2.8 and later and a plain ``RuntimeError`` before, and other backends word
theirs their own way. The product survives each the same way; these are the cases its tests raise.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from core.devices.sim.device import SimulatedDevice


def _accelerator_error(message: str, code: int | None = None) -> BaseException:
    """A ``torch.AcceleratorError`` (skips the test where this torch has none: before 2.8)."""
    kind = getattr(torch, "AcceleratorError", None)
    if kind is None:
        pytest.skip(f"torch {torch.__version__} has no torch.AcceleratorError (it came with torch 2.8)")
    error = kind(message)
    if code is not None:
        error.error_code = code  # what torch sets on the ones it raises
    return error


#: The out-of-memory errors of every kind the product must survive, by name: each a factory, so that a case
#: torch cannot build here skips only itself.
OUT_OF_MEMORY: dict[str, Callable[[], BaseException]] = {
    "cuda allocator": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB."),
    "cuda runtime (AcceleratorError)": lambda: _accelerator_error(
        "CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation' in https://docs.nvidia.com/cuda/", 2
    ),
    "cuda runtime, older torch": lambda: RuntimeError("CUDA error: out of memory"),
    "hip runtime": lambda: RuntimeError("HIP error: out of memory"),
    "cublas handle": lambda: RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    "xpu allocator": lambda: RuntimeError("XPU out of memory. Tried to allocate 20.00 MiB."),
    "level zero": lambda: RuntimeError("level_zero backend failed with error: UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY"),
    "mps allocator": lambda: RuntimeError(
        "MPS backend out of memory (MPS allocated: 1.49 GiB, other allocations: 6.01 GiB, max allowed: 9.07 GiB)."
    ),
    "directml": lambda: RuntimeError(
        "Could not allocate tensor with 4194304 bytes. There is not enough GPU video memory available!"
    ),
}

#: Errors that are not out of memory, though some come from the same classes or mention memory.
NOT_OUT_OF_MEMORY: dict[str, Callable[[], BaseException]] = {
    "illegal access (AcceleratorError)": lambda: _accelerator_error(
        "CUDA error: an illegal memory access was encountered", 700
    ),
    "illegal access, older torch": lambda: RuntimeError("CUDA error: an illegal memory access was encountered"),
    "device mismatch": lambda: RuntimeError("Expected all tensors to be on the same device, but found cuda:0 and cpu"),
    "host memory": lambda: RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 4 GiB."),
    "not a runtime error": lambda: ValueError("out of memory"),
}


def fail_moves(
    monkeypatch: pytest.MonkeyPatch,
    device: SimulatedDevice,
    error: Callable[[], BaseException],
    after: int,
    times: int = 1,
) -> None:
    """Make ``times`` moves onto ``device``, from the one after the next ``after``, raise a new ``error()`` (the
    moves after them work again), as a runtime call that fails under memory pressure in the middle of a load
    does. A new one each time, as a runtime raises: one kept and raised again would keep the frames of its last
    traceback, and the tensors they hold, alive."""
    error()  # a case this torch cannot build skips before anything is patched
    calls = itertools.count()

    def failing(method: Callable[..., Any]) -> Callable[..., Any]:
        def move(*args: Any, **kwargs: Any) -> Any:
            if after <= next(calls) < after + times:
                raise error()
            return method(*args, **kwargs)

        return move

    for name in ("place", "place_in_place"):  # a buffer is placed as a new tensor, a parameter in place
        monkeypatch.setattr(device, name, failing(getattr(device, name)))
