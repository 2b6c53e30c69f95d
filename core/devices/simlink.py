"""The simulated GPU's link to the host and its streams: copies that take the time a real link would.

A copy costs ``latency + bytes / bandwidth`` (``DEVICE_CONTROL_SIMULATE_LINK``, e.g. ``16GB/s,10us``; unset,
copies are free, as they always were). An optional third part, ``compute=10x``, says the simulated GPU computes
ten times faster than the host: the host cannot compute faster, so every copy takes ten times longer instead,
which keeps the ratio of copying to computing a real GPU that fast would see (times are then host times, ten
times a real GPU's). Each direction of the link is a copy engine with its own clock, as on
a PCIe GPU: a copy starts when the engine is free and ends ``cost`` later. A blocking copy makes the host wait
for its end; a copy queued on a side stream from pinned memory does not, so it overlaps the computation that
runs meanwhile on the host (the simulated GPU computes on the host, on its main stream).

Streams keep CUDA's ordering rules, checked rather than assumed: work queued on a stream gets a sequence
number; an event records a stream's position; a stream that waits on an event may use everything queued on
the other stream up to that position. A computation on the main stream that reads a tensor a side stream
made, without having waited for it, raises :class:`MissingWaitError`: a missing wait is a test failure on a
machine with no GPU, where on a real one it would be a rare wrong image.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field

from ..errors import InvalidSizeError
from ..units import parse_size

LINK_ENV = "DEVICE_CONTROL_SIMULATE_LINK"

#: Below this much time owed, a blocking copy does not sleep (sleeps that short overshoot); the debt is kept
#: on the link's clock and paid by the next sleep, so the total time stays exact.
_MIN_SLEEP = 0.001

_LATENCY_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_LATENCY_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(s|ms|us|µs|ns)\s*$", re.IGNORECASE)
_SPEEDUP_RE = re.compile(r"^compute\s*=\s*([0-9]*\.?[0-9]+)\s*x?\s*$", re.IGNORECASE)
_EXAMPLE = (
    f"write it like {LINK_ENV}=16GB/s,10us (bandwidth per second, then the latency of one copy, then optionally "
    "how many times faster than this machine the simulated GPU computes: 16GB/s,10us,compute=10x)"
)


class MissingWaitError(RuntimeError):
    """A computation read a tensor whose copy on another stream it had not waited for."""


@dataclass(frozen=True)
class LinkCost:
    """What one copy over the link costs: ``latency`` seconds plus its bytes over ``bandwidth`` (bytes/s), times
    ``compute_speedup`` (how many times faster than the host the simulated GPU computes).

    ``bandwidth`` ``None`` is a free link (the default: copies take no time).
    """

    bandwidth: float | None = None
    latency: float = 0.0
    compute_speedup: float = 1.0

    @property
    def free(self) -> bool:
        """Whether copies cost nothing."""
        return self.bandwidth is None and self.latency == 0

    def seconds(self, nbytes: int) -> float:
        """How long copying ``nbytes`` takes."""
        return (self.latency + (nbytes / self.bandwidth if self.bandwidth else 0.0)) * self.compute_speedup

    @classmethod
    def parse(cls, text: str | None) -> LinkCost:
        """Parse ``"16GB/s,10us"``, ``"7GB/s"``, ``"25GB/s,10us,compute=10x"`` or ``""`` (free).

        Raises:
            InvalidSizeError: the text is not a bandwidth, an optional latency and an optional compute speed-up
                (the message shows the form).
        """
        parts = [part.strip() for part in (text or "").split(",") if part.strip()]
        if not parts:
            return cls()
        speedup = _speedup(text, parts.pop()) if parts[-1].lower().startswith("compute=") else 1.0
        bandwidth = _bandwidth(text, parts)
        latency = _latency(text, parts[1]) if len(parts) == 2 else 0.0
        return cls(bandwidth, latency, speedup)


def _bandwidth(text: str | None, parts: list[str]) -> float:
    """The bandwidth in bytes per second from the first of ``parts`` (a bandwidth and an optional latency)."""
    if not parts or len(parts) > 2 or not parts[0].lower().endswith("/s"):
        raise InvalidSizeError(f"{LINK_ENV}={text!r} is not a link; {_EXAMPLE}.")
    bandwidth = parse_size(parts[0][:-2])
    if bandwidth <= 0:
        raise InvalidSizeError(f"{LINK_ENV}={text!r}: the bandwidth must be more than 0; {_EXAMPLE}.")
    return float(bandwidth)


def _latency(text: str | None, part: str) -> float:
    """``10us`` -> 1e-05 seconds."""
    match = _LATENCY_RE.match(part)
    if match is None:
        raise InvalidSizeError(f"{LINK_ENV}={text!r}: {part!r} is not a latency; {_EXAMPLE}.")
    return float(match.group(1)) * _LATENCY_UNITS[match.group(2).lower()]


def _speedup(text: str | None, part: str) -> float:
    """``compute=10x`` -> 10.0 (a factor of at least 1)."""
    match = _SPEEDUP_RE.match(part)
    if match is None or float(match.group(1)) < 1:
        raise InvalidSizeError(
            f"{LINK_ENV}={text!r}: {part!r} is not a compute speed-up of at least 1 (like compute=10x); {_EXAMPLE}."
        )
    return float(match.group(1))


@dataclass(eq=False)
class SimStream:
    """A stream of the simulated GPU: a name, its link, the number of the last work queued on it, and how far
    it has waited for each other stream (``synced[other]`` is the last number of ``other`` it may use)."""

    name: str
    link: Link = field(repr=False)
    queued: int = 0
    busy_until: float = 0.0
    synced: dict[SimStream, int] = field(default_factory=dict)


@dataclass(frozen=True)
class SimEvent:
    """A stream's position at one moment: its last queued work and when that work ends."""

    stream: SimStream
    position: int
    ready_at: float


@dataclass(frozen=True)
class Pending:
    """What a tensor made on a side stream carries until it is used: the work that made it."""

    stream: SimStream
    position: int


class Link:
    """The link of one simulated device: its cost, its two copy engines' clocks and its streams."""

    def __init__(self, cost: LinkCost) -> None:
        self.cost = cost
        self.main = SimStream("main", self)
        self.side = SimStream("copy", self)
        self._local = threading.local()
        self._engines = {"to_device": 0.0, "to_host": 0.0}
        self._lock = threading.Lock()

    @property
    def current(self) -> SimStream:
        """The stream work is queued on now in this thread (the main one outside :meth:`on`)."""
        return getattr(self._local, "stream", self.main)

    def set_current(self, stream: SimStream | None) -> SimStream:
        """Make ``stream`` current in this thread (``None``: the main one); return the one it replaces."""
        previous = self.current
        self._local.stream = stream or self.main
        return previous

    def copy(self, nbytes: int, direction: str, *, host_waits: bool) -> Pending | None:
        """Book one copy of ``nbytes`` (``"to_device"`` or ``"to_host"``) on the current stream.

        The host waits for its end when ``host_waits`` (a blocking copy, or one from memory that is not
        pinned). Returns what a tensor made by a copy on a side stream must carry (``None`` on the main one).
        """
        stream = self.current
        with self._lock:
            end = self._engines[direction]
            if not self.cost.free:
                end = max(time.monotonic(), end, stream.busy_until) + self.cost.seconds(nbytes)
                self._engines[direction] = end
            stream.queued += 1
            stream.busy_until = max(stream.busy_until, end)
            position = stream.queued
        if host_waits:
            _sleep_until(end, _MIN_SLEEP)
        return None if stream is self.main else Pending(stream, position)

    def record(self, stream: SimStream) -> SimEvent:
        """An event at ``stream``'s current position."""
        with self._lock:
            return SimEvent(stream, stream.queued, stream.busy_until)

    def wait(self, stream: SimStream, event: SimEvent) -> None:
        """Order ``stream`` after ``event``. The main stream is the host's computation, so the host waits."""
        with self._lock:
            stream.synced[event.stream] = max(stream.synced.get(event.stream, 0), event.position)
            stream.busy_until = max(stream.busy_until, event.ready_at)
        if stream is self.main:
            _sleep_until(event.ready_at, 0.0)

    def check_ready(self, pending: Pending, label: str) -> None:
        """Raise :class:`MissingWaitError` when the current stream may not use the work ``pending`` names."""
        stream = self.current
        if pending.stream is stream or stream.synced.get(pending.stream, 0) >= pending.position:
            return
        raise MissingWaitError(
            f"{label}: a computation on the {stream.name} stream read a tensor copied on the {pending.stream.name} "
            "stream without waiting for that copy (record an event after the copy and wait on it before use)."
        )

    def synchronize(self) -> None:
        """Wait on the host until every copy queued so far has ended."""
        with self._lock:
            end = max(self._engines.values())
        _sleep_until(end, 0.0)


def _sleep_until(deadline: float, least: float) -> None:
    """Sleep until ``deadline`` (monotonic), unless less than ``least`` seconds are left."""
    left = deadline - time.monotonic()
    if left > least:
        time.sleep(left)
