"""A mark on weights that stay in host memory on purpose: streamed layers cast them to the device per use.

Code that checks devices (the simulated GPU's mismatch check) lets a marked weight through, and catches an
unmarked one left behind: a forgotten move.
"""

from __future__ import annotations

import torch

_STREAMED = "_device_control_streamed"


def mark_streamed(tensor: torch.Tensor, streamed: bool = True) -> None:
    """Mark a host weight as streamed: it stays in host memory and is cast to the device for each use."""
    setattr(tensor, _STREAMED, streamed)


def is_streamed(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` carries the streamed mark."""
    return getattr(tensor, _STREAMED, False)
