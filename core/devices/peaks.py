"""The peak allocation of an interval, read from a device's peak counter without resetting it.

A backend's peak counter (``torch.cuda.max_memory_allocated``, the simulated GPU's) is global: other tools read
it, and resetting it (``reset_peak_memory_stats``) changes what they see. ``DEVICE_CONTROL_PEAKS`` says what the
pack may do with it:

* ``keep`` (the default): the pack never resets a counter. An interval's peak is derived from the counter and the
  allocation read at the interval's two ends (:func:`interval_peak`): when the counter rose, the interval set a
  new high and its peak is exactly the counter; otherwise the peak is only known to be at least the allocations
  read and the sub-interval peaks measured inside it, and the figure says so (:attr:`Peak.exact` false).
* ``reset``: the pack resets every counter at each reading (the VRAM Report and each node of the memory profile),
  so every peak is exact, and another tool reading the counter sees the peak since the pack's last reading.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger("device_control")

__all__ = ["KEEP", "PEAKS_ENV", "RESET", "Mark", "Peak", "interval_peak", "peaks_from_env"]

PEAKS_ENV = "DEVICE_CONTROL_PEAKS"
KEEP = "keep"
RESET = "reset"


def peaks_from_env(environ: Mapping[str, str] | None = None) -> str:
    """What the pack may do with the peak counters, from ``DEVICE_CONTROL_PEAKS``: :data:`KEEP` (the default) or
    :data:`RESET`. Another value is logged with the fix, and the counters are kept."""
    text = (os.environ if environ is None else environ).get(PEAKS_ENV, "").strip().lower()
    if text in ("", KEEP):
        return KEEP
    if text == RESET:
        return RESET
    log.error(
        "[Device Control] %s=%r is neither keep nor reset; peak counters are kept (%s=reset for exact peaks).",
        PEAKS_ENV,
        text,
        PEAKS_ENV,
    )
    return KEEP


@dataclass(frozen=True)
class Mark:
    """A device's peak counter and its allocation, read at one moment (bytes)."""

    peak: int
    allocated: int


@dataclass(frozen=True)
class Peak:
    """The peak allocation of an interval: ``value`` bytes exactly, or at least that when ``exact`` is false."""

    value: int
    exact: bool = True


def interval_peak(start: Mark | None, end: Mark, carried: Peak | None = None) -> Peak:
    """The peak allocation between two marks of one device's counter, which nobody in the pack reset in between.

    Args:
        start: the mark at the interval's start; ``None`` where the counter itself started then (the process
            started, or the pack reset it), so the counter is the interval's peak.
        end: the mark at the interval's end.
        carried: the highest peak measured on a sub-interval inside this one (exact or a lower bound).

    Returns:
        The counter when it rose (a new high: exact); otherwise the highest of the allocations read and
        ``carried``, a lower bound (exact only where it reaches the counter, the upper bound). A counter that fell
        was reset by someone else: at least what it counts since.
    """
    floor = max(end.allocated, carried.value if carried is not None else 0)
    if start is None:
        return Peak(max(end.peak, floor))
    floor = max(floor, start.allocated)
    if end.peak > start.peak:
        return Peak(max(end.peak, floor))
    if end.peak < start.peak:
        return Peak(max(end.peak, floor), exact=False)
    return Peak(floor, exact=floor >= end.peak)
