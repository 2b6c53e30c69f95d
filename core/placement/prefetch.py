"""Prefetch: how many groups of streamed weights cross ahead of the one computing.

Prefetch is a property of a model's ring (``core.placement.ring``): the next group in the order the model runs in
is copied while the current one computes, on the device's side stream; a step then takes about the longer of its
computation and its copies instead of their sum. It changes when copies are issued, not how much host work they
take, so it cannot make a step slower. ``DEVICE_CONTROL_PREFETCH=off`` turns it off (one slot, copied when
reached), to measure what it gains or to rule it out when looking for a fault.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..errors import InvalidSizeError

PREFETCH_ENV = "DEVICE_CONTROL_PREFETCH"
#: Slots of a ring while prefetching: the group computing and the one crossing meanwhile.
PREFETCH_SLOTS = 2

_enabled = True


def prefetch_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether to prefetch, from ``DEVICE_CONTROL_PREFETCH`` (``on`` or ``off``; default on).

    Raises:
        InvalidSizeError: the value is neither (the message shows how to write it).
    """
    text = (os.environ if environ is None else environ).get(PREFETCH_ENV, "").strip().lower()
    if text in ("", "on", "1", "true", "yes"):
        return True
    if text in ("off", "0", "false", "no"):
        return False
    raise InvalidSizeError(f"{PREFETCH_ENV}={text!r} is neither on nor off; write {PREFETCH_ENV}=off to turn it off.")


def use_prefetch(enabled: bool) -> None:
    """Prefetch (or not) for models loaded from now on (the settings do this at start)."""
    global _enabled
    _enabled = enabled


def prefetching() -> bool:
    """Whether models loaded from now on prefetch (:func:`use_prefetch`)."""
    return _enabled
