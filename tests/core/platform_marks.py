"""Marks for tests whose subject a simulated platform does not have (``core.devices.sim.platforms``)."""

from __future__ import annotations

import pytest

from core.devices.host_memory import platform

#: A rule of GPUs with streams, events and page-locked host memory (CUDA, ROCm, XPU). On the macOS profile the
#: simulated GPU is like Apple's MPS, with unified memory: it has neither, and the engine runs without them
#: (``tests/core/test_platforms.py`` checks it does).
STREAMS_AND_PINNING = pytest.mark.skipif(
    platform().unified_memory,
    reason="a rule of streams and page-locked memory: the simulated GPU of a unified-memory platform has neither",
)
