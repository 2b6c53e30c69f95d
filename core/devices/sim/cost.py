"""What a copy over the simulated GPU's link costs, as ``DEVICE_CONTROL_SIMULATE_LINK`` says: the setting's
grammar and the figures it fills in (pageable bandwidth, the host's issue time, the launch queue's depth).

The link that charges these costs, its clocks and its waits, is ``core.devices.sim.link``; this module is the
setting alone, which ``core.devices.sim.spec`` reads with the simulated GPU's other settings and the benchmarks read
to describe a link.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ...errors import InvalidSizeError
from ...units import parse_size

LINK_ENV = "DEVICE_CONTROL_SIMULATE_LINK"

#: Pageable over pinned host-to-device bandwidth, measured on an H100 (PCIe gen 5): 7.5 GB/s against 53.3 GB/s.
PAGEABLE_RATIO = 7.5 / 53.3
#: Host time to issue one copy (driver call plus torch's dispatch): an estimate, not a measurement.
DEFAULT_ISSUE_SECONDS = 10e-6
#: How many copies the host may queue on a stream ahead of the device: CUDA's launch queue is about this deep.
DEFAULT_QUEUE_DEPTH = 1024

_LATENCY_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_LATENCY_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(s|ms|us|µs|ns)\s*$", re.IGNORECASE)
_SPEEDUP_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*x?\s*$", re.IGNORECASE)
_COUNT_RE = re.compile(r"^\s*([0-9]+)\s*$")
_EXAMPLE = (
    f"write it like {LINK_ENV}=16GB/s,10us: the bandwidth from pinned memory, then optionally the latency of one "
    "copy and, in any order, compute=10x (how much faster than this machine the GPU computes), pageable=7.5GB/s "
    "(from memory not pinned), issue=10us (host time per copy) and queue=1024 (copies queued ahead at most)"
)


@dataclass(frozen=True)
class LinkCost:
    """What one copy over the link costs the device and the host.

    A copy takes ``latency`` seconds plus its bytes over ``bandwidth`` (bytes/s, from pinned memory) or over
    ``pageable_bandwidth`` (from memory that is not pinned), times ``compute_speedup`` (how many times faster than
    the host the simulated GPU computes). Before that, the host spends ``issue_seconds`` issuing it (also times
    ``compute_speedup``), and it may have at most ``queue_depth`` copies queued and not ended on one stream.

    ``bandwidth`` ``None`` (no latency, no pageable bandwidth) is the free link, the default: nothing costs. Filled
    in when not given: ``pageable_bandwidth`` is ``bandwidth`` times :data:`PAGEABLE_RATIO`; ``issue_seconds`` is
    :data:`DEFAULT_ISSUE_SECONDS` when copies cost anything, 0 on the free link.
    """

    bandwidth: float | None = None
    latency: float = 0.0
    compute_speedup: float = 1.0
    pageable_bandwidth: float | None = None
    issue_seconds: float | None = None
    queue_depth: int = DEFAULT_QUEUE_DEPTH

    def __post_init__(self) -> None:
        if self.pageable_bandwidth is None and self.bandwidth is not None:
            object.__setattr__(self, "pageable_bandwidth", self.bandwidth * PAGEABLE_RATIO)
        if self.issue_seconds is None:
            costs = self.bandwidth is not None or self.pageable_bandwidth is not None or self.latency > 0
            object.__setattr__(self, "issue_seconds", DEFAULT_ISSUE_SECONDS if costs else 0.0)
        _check_cost(self)

    @property
    def free(self) -> bool:
        """Whether copies cost nothing, neither device time nor host time."""
        return (
            self.bandwidth is None and self.pageable_bandwidth is None and self.latency == 0 and not self.issue_seconds
        )

    @property
    def issue_time(self) -> float:
        """The host's time to issue one copy, in host seconds (scaled by ``compute_speedup`` like every time)."""
        return (self.issue_seconds or 0.0) * self.compute_speedup

    def seconds(self, nbytes: int, *, pinned: bool = True) -> float:
        """How long copying ``nbytes`` takes on the link, from pinned memory or (``pinned=False``) pageable."""
        bandwidth = self.bandwidth if pinned else self.pageable_bandwidth
        return (self.latency + (nbytes / bandwidth if bandwidth else 0.0)) * self.compute_speedup

    @classmethod
    def parse(cls, text: str | None) -> LinkCost:
        """Parse ``DEVICE_CONTROL_SIMULATE_LINK``: a bandwidth, then in any order an optional latency and optional
        named parts ``compute=10x``, ``pageable=7.5GB/s``, ``issue=10us``, ``queue=1024``, each at most once.

        ``"16GB/s,10us"``, ``"7GB/s"``, ``"25GB/s,10us,compute=10x"``, ``"53GB/s,issue=5us,pageable=7.5GB/s"``;
        ``""`` or ``None`` is the free link.

        Raises:
            InvalidSizeError: the text is not of that form (the message shows it).
        """
        parts = [part.strip() for part in (text or "").split(",") if part.strip()]
        if not parts:
            return cls()
        bandwidth = _rate(text, parts[0], "the bandwidth")
        latency, named = _rest(text, parts[1:])
        return cls(
            bandwidth,
            latency or 0.0,
            float(named.get("compute", 1.0)),
            pageable_bandwidth=float(named["pageable"]) if "pageable" in named else None,
            issue_seconds=float(named["issue"]) if "issue" in named else None,
            queue_depth=int(named.get("queue", DEFAULT_QUEUE_DEPTH)),
        )


def _check_cost(cost: LinkCost) -> None:
    """Raise ``ValueError`` for a cost no link has (a direct construction's mistake; parsing names the form)."""
    for name in ("bandwidth", "pageable_bandwidth"):
        value = getattr(cost, name)
        if value is not None and not value > 0:
            raise ValueError(f"LinkCost.{name} must be more than 0 bytes per second (or None), not {value!r}.")
    if not (cost.latency >= 0 and (cost.issue_seconds or 0.0) >= 0):
        raise ValueError(f"LinkCost times must be 0 or more: latency={cost.latency!r}, issue={cost.issue_seconds!r}.")
    if not cost.compute_speedup >= 1:
        raise ValueError(f"LinkCost.compute_speedup must be at least 1, not {cost.compute_speedup!r}.")
    depth = cost.queue_depth
    if type(depth) is not int or depth < 1:  # a bool is not a depth
        raise ValueError(f"LinkCost.queue_depth must be a whole number of at least 1, not {depth!r}.")


def _rest(text: str | None, parts: list[str]) -> tuple[float | None, dict[str, float | int]]:
    """The latency (unnamed, at most one) and the named parts after a link's bandwidth."""
    latency: float | None = None
    named: dict[str, float | int] = {}
    for part in parts:
        name, equals, value = part.partition("=")
        key = name.strip().lower()
        if not equals and latency is not None:
            raise InvalidSizeError(
                f"{LINK_ENV}={text!r}: {part!r} is a second unnamed part (only the latency goes unnamed); {_EXAMPLE}."
            )
        if not equals:
            latency = _seconds(text, part, "a latency")
        elif key not in _NAMED:
            raise InvalidSizeError(f"{LINK_ENV}={text!r}: {part!r} is not a part of a link; {_EXAMPLE}.")
        elif key in named:
            raise InvalidSizeError(f"{LINK_ENV}={text!r}: {key}= is given twice; {_EXAMPLE}.")
        else:
            named[key] = _NAMED[key](text, value.strip())
    return latency, named


def _rate(text: str | None, part: str, what: str) -> float:
    """``16GB/s`` -> bytes per second (more than 0); ``what`` names it in the error."""
    if not part.lower().endswith("/s"):
        raise InvalidSizeError(f"{LINK_ENV}={text!r}: {part!r} is not {what} (like 16GB/s); {_EXAMPLE}.")
    try:
        rate = parse_size(part[:-2])
    except InvalidSizeError as error:
        raise InvalidSizeError(f"{LINK_ENV}={text!r}: {part!r} is not {what} ({error}); {_EXAMPLE}.") from None
    if rate <= 0:
        raise InvalidSizeError(f"{LINK_ENV}={text!r}: {what} must be more than 0; {_EXAMPLE}.")
    return float(rate)


def _seconds(text: str | None, part: str, what: str) -> float:
    """``10us`` -> 1e-05 seconds; ``what`` names it in the error."""
    match = _LATENCY_RE.match(part)
    if match is None:
        raise InvalidSizeError(f"{LINK_ENV}={text!r}: {part!r} is not {what} (like 10us); {_EXAMPLE}.")
    return float(match.group(1)) * _LATENCY_UNITS[match.group(2).lower()]


def _speedup(text: str | None, value: str) -> float:
    """``10x`` (of ``compute=10x``) -> 10.0 (a factor of at least 1)."""
    match = _SPEEDUP_RE.match(value)
    if match is None or float(match.group(1)) < 1:
        raise InvalidSizeError(
            f"{LINK_ENV}={text!r}: compute={value} is not a compute speed-up of at least 1 (like compute=10x); "
            f"{_EXAMPLE}."
        )
    return float(match.group(1))


def _queue(text: str | None, value: str) -> int:
    """``1024`` (of ``queue=1024``) -> 1024 (a whole number of at least 1)."""
    match = _COUNT_RE.match(value)
    if match is None or int(match.group(1)) < 1:
        raise InvalidSizeError(
            f"{LINK_ENV}={text!r}: queue={value} is not a number of copies of at least 1 (like queue=1024); {_EXAMPLE}."
        )
    return int(match.group(1))


#: The named parts of a link after its bandwidth, each with how its value is read.
_NAMED: dict[str, Callable[[str | None, str], float | int]] = {
    "compute": _speedup,
    "pageable": lambda text, value: _rate(text, value, "a pageable bandwidth"),
    "issue": lambda text, value: _seconds(text, value, "an issue time"),
    "queue": _queue,
}
