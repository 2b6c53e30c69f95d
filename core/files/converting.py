"""Dtype conversions of weights as they are read: through float32, in steps, where torch is slow at them directly.

Torch converts float16 (and a few other pairs) to another reduced dtype one element at a time through a slow
scalar path: on a CPU core float16 -> float8_e4m3fn runs at about 0.5 billion elements a second, float16 ->
float32 at 3.6 and float32 -> float8_e4m3fn at 1.3, so going through float32 is about twice as fast (2.0x for
float16 -> float8_e4m3fn, 2.8x for float16 -> float8_e5m2, 2.0x for bfloat16 -> float16). It is also exact:
every value of a 16-bit or 8-bit dtype is exactly a float32, and torch's direct conversions go through float32
too (a test checks every 16-bit and 8-bit value, NaNs included). Pairs that are as fast directly (bfloat16 ->
float8, any conversion to float32) are left to torch, and so are conversions to bfloat16, whose NaNs come out
with another bit pattern through float32.

A large tensor is split among as many threads as torch uses (``torch.get_num_threads()``), each converting its
part step by step: the cores work in parallel without meeting at a barrier after every step, which, where other
programs keep the cores busy, costs more than the conversion (measured: a load twice as slow with torch's own
threads on steps of 4 Mi elements). How large a step is depends on where torch keeps its thread count:

* with the OpenMP backend (that of torch's Linux builds; ``torch.__config__.parallel_info()`` names it) the
  count is each thread's own, so the converting threads set theirs to one and convert 262,144 elements a call
  (1 MiB of float32, in a core's L2 and L3): measured on 2 cores, float16 -> float8_e4m3fn from a mapped file
  1.6x as fast as with the small steps below, where the Python and dispatch cost of each call weighs;
* with any other backend the count is the process's, which a converting thread must not change: steps of 32,767
  elements, below torch's parallel grain (32,768), run on the thread that asks for them, and the first part runs
  on the calling thread.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import torch

#: (stored dtype, target dtype) pairs converted faster through float32 (measured on a CPU core; see above).
VIA_FLOAT32 = frozenset(
    {
        (torch.float16, torch.float8_e4m3fn),
        (torch.float16, torch.float8_e5m2),
        (torch.bfloat16, torch.float16),
        (torch.float8_e5m2, torch.float8_e4m3fn),
    }
)
#: Elements per step where a converting thread cannot run torch on one thread only: below torch's parallel grain
#: (32,768), so each step runs on the thread that asks for it.
STEP = 32767
#: Elements per step where each converting thread runs torch on one thread (its own count: OpenMP).
LARGE_STEP = 1 << 18
#: A tensor is split among threads from this many elements on (below, starting threads costs more than it saves).
SPLIT_FROM = 1 << 20


class Float32Steps:
    """Copies with a dtype conversion, through float32 steps where that is faster (``VIA_FLOAT32``).

    Args:
        threads: how many threads convert one large tensor (default: as many as torch uses).
    """

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, threads or torch.get_num_threads())
        self._pool: ThreadPoolExecutor | None = None

    def copy(self, dest: torch.Tensor, source: torch.Tensor) -> None:
        """``dest.copy_(source)`` for a ``source`` with as many elements (any shape), bit for bit the same result."""
        if not _through_float32(dest, source):
            with torch.no_grad():
                dest.copy_(source.reshape(dest.shape))
            return
        flat_dest, flat_source = dest.view(-1), source.reshape(-1)
        own_counts = thread_counts_are_per_thread()
        step = LARGE_STEP if own_counts else STEP
        bounds = _parts(flat_dest.numel(), self.threads, step)
        inference = torch.is_inference_mode_enabled()
        # With per-thread counts every part goes to a converting thread (the calling thread keeps torch's count).
        here = [] if own_counts else bounds[:1]
        work = [(flat_dest, flat_source, *part, step, inference) for part in bounds[len(here) :]]
        others = [self._workers(own_counts).submit(_steps, *args) for args in work]
        try:
            for part in here:
                _steps(flat_dest, flat_source, *part, step, inference)
        finally:
            for other in others:
                other.result()  # waits for every part, and raises what a part raised

    def _workers(self, own_counts: bool) -> ThreadPoolExecutor:
        """The converting threads (started at the first tensor that needs them): with per-thread counts one per
        part, each running torch on itself alone; else one fewer, the calling thread converting the first part."""
        if self._pool is None:
            workers, setup = (self.threads, _one_torch_thread) if own_counts else (self.threads - 1, None)
            self._pool = ThreadPoolExecutor(workers, thread_name_prefix="device_control-convert", initializer=setup)
        return self._pool

    def release(self) -> None:
        """Stop the threads (the reader is closed)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _through_float32(dest: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether this copy goes through float32 steps: a pair in ``VIA_FLOAT32``, in host memory, into a
    contiguous tensor (anything else is torch's own ``copy_``)."""
    on_host = dest.device.type == "cpu" and source.device.type == "cpu"
    return on_host and dest.is_contiguous() and (source.dtype, dest.dtype) in VIA_FLOAT32


@functools.cache
def thread_counts_are_per_thread() -> bool:
    """Whether torch's intra-op thread count is each thread's own (its OpenMP backend), so that a converting thread
    may run torch on one thread without changing it for the rest of the process."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def _one_torch_thread() -> None:
    """Set up a converting thread: torch runs its steps on this thread only (OpenMP: this thread's count)."""
    torch.set_num_threads(1)


def _parts(total: int, threads: int, step: int) -> list[tuple[int, int]]:
    """``[begin, end)`` of each thread's part of ``total`` elements, on whole steps (none for no element)."""
    parts = min(threads, max(1, total // SPLIT_FROM))
    size = max(1, -(-total // parts // step)) * step
    return [(begin, min(total, begin + size)) for begin in range(0, total, size)]


def _steps(dest: torch.Tensor, source: torch.Tensor, begin: int, end: int, step: int, inference: bool) -> None:
    """Convert ``source[begin:end]`` into ``dest[begin:end]`` step by step through a float32 buffer of one step
    (in the caller's inference mode: tensors made under it can only be written under it)."""
    with torch.inference_mode(inference), torch.no_grad():
        buffer = torch.empty(min(step, end - begin), dtype=torch.float32)
        for part, out in zip(source[begin:end].split(step), dest[begin:end].split(step), strict=True):
            staged = buffer[: part.numel()]
            staged.copy_(part)
            out.copy_(staged)
