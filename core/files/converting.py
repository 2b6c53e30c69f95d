"""Dtype conversions of weights as they are read: through float32, in steps, where torch is slow at them directly.

Torch converts float16 (and a few other pairs) to another reduced dtype one element at a time through a slow
scalar path: on a CPU core float16 -> float8_e4m3fn runs at about 0.5 billion elements a second, float16 ->
float32 at 3.6 and float32 -> float8_e4m3fn at 1.3, so going through float32 is about twice as fast (2.0x for
float16 -> float8_e4m3fn, 2.8x for float16 -> float8_e5m2, 2.0x for bfloat16 -> float16). It is also exact:
every value of a 16-bit or 8-bit dtype is exactly a float32, and torch's direct conversions go through float32
too (a test checks every 16-bit and 8-bit value, NaNs included). Pairs that are as fast directly (bfloat16 ->
float8, any conversion to float32) are left to torch, and so are conversions to bfloat16, whose NaNs come out
with another bit pattern through float32.

The float32 steps are small (a few MiB, kept in a reused buffer), so they stay in the CPU's caches and add no
memory beyond that buffer.
"""

from __future__ import annotations

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
#: Elements per step: 16 MiB of float32, few enough steps that torch's threads start rarely, small enough to
#: stay in a CPU's last-level cache.
STEP = 4 * 1024**2


class Float32Steps:
    """Copies with a dtype conversion, through a reused float32 buffer where that is faster (``VIA_FLOAT32``)."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.float32)

    def copy(self, dest: torch.Tensor, source: torch.Tensor) -> None:
        """``dest.copy_(source)`` for a ``source`` with as many elements (any shape), bit for bit the same result."""
        flat_dest = dest.view(-1) if dest.is_contiguous() else None
        on_host = dest.device.type == "cpu" and source.device.type == "cpu"
        if flat_dest is None or not on_host or (source.dtype, dest.dtype) not in VIA_FLOAT32:
            with torch.no_grad():
                dest.copy_(source.reshape(dest.shape))
            return
        flat_source, total = source.reshape(-1), flat_dest.numel()
        if self._buffer.numel() < min(total, STEP):
            self._buffer = torch.empty(min(total, STEP), dtype=torch.float32)
        with torch.no_grad():
            for begin in range(0, total, STEP):
                end = min(total, begin + STEP)
                step = self._buffer[: end - begin]
                step.copy_(flat_source[begin:end])
                flat_dest[begin:end].copy_(step)

    def release(self) -> None:
        """Give the buffer back (the reader is closed)."""
        self._buffer = torch.empty(0, dtype=torch.float32)
