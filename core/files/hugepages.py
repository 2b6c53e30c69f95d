"""Ask Linux to back a freshly allocated, still untouched host tensor with 2 MiB pages.

A loader writes every byte of every weight once, into memory nobody has touched yet; each 4 KiB page the kernel
hands out costs a page fault (a 5 GiB text encoder: 1.3 million of them). With ``transparent_hugepage`` set to
``madvise`` (the default of many distributions) the kernel uses 2 MiB pages only where a program asks, which is
what torch's own ``THP_MEM_ALLOC_ENABLE`` does for its allocations; this asks for the aligned inside of one tensor
only. Where the kernel has no transparent huge pages, or on another system, it does nothing. Measured on the
SD3.5 text encoders (fp16 file loaded as fp8, one core): 0.2 instead of 1.25 million page faults, and about 40 %
less time in the kernel.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

import torch

HUGE_PAGE = 2 * 1024**2
_MADV_HUGEPAGE = 14  # linux/mman.h


def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    function.restype = ctypes.c_int
    return function


_MADVISE = _madvise()


def advise_huge_pages(tensor: torch.Tensor) -> None:
    """Ask for 2 MiB pages under the 2 MiB-aligned inside of ``tensor``'s host memory (a hint: never fails)."""
    if _MADVISE is None or tensor.device.type != "cpu" or tensor.nbytes < 2 * HUGE_PAGE:
        return
    start = tensor.data_ptr()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = (start + tensor.nbytes) // HUGE_PAGE * HUGE_PAGE
    if last > first:
        _MADVISE(first, last - first, _MADV_HUGEPAGE)  # EINVAL where the kernel has no THP: a hint, ignored
