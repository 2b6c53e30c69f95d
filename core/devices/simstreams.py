"""The streams and events of the simulated GPU's link (``core.devices.simlink``), with CUDA's ordering rules, and
the device's clock for its computations.

Work queued on a stream gets a sequence number; an event records a stream's position, and how far that stream had
waited for each other one; a stream that waits on an event may use everything queued on the other stream up to that
position, and a host that waits for an event knows all that work ended.

The simulated GPU computes on the host, so a host that waits for the device's computations would wait for nothing
here, where a real host, which runs ahead of its GPU, loses its lead: :class:`ComputeClock` keeps the time the
computations queued on the compute stream would take the device (each takes the host's time for it, the time unit of
the simulation) and what the host did meanwhile, and counts each host wait that finds computations not ended.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .simlink import Link


@dataclass(eq=False)
class SimStream:
    """A stream of the simulated GPU: a name, its link, the number of the last work queued on it, and how far
    it has waited for each other stream (``synced[other]`` is the last number of ``other`` it may use).

    ``in_flight`` holds the end times of the copies queued on it that may not have ended yet, oldest first (the
    ends on one stream only grow), so the host can be made to wait when more are queued than the link allows.
    """

    name: str
    link: Link = field(repr=False)
    queued: int = 0
    busy_until: float = 0.0
    synced: dict[SimStream, int] = field(default_factory=dict)
    in_flight: deque[float] = field(default_factory=deque, repr=False)


@dataclass(frozen=True)
class SimEvent:
    """A stream's position at one moment: its last queued work and when that work ends; ``covers``: how far the
    stream had waited for each other stream then (a host that waits for the event waits for those too)."""

    stream: SimStream
    position: int
    ready_at: float
    covers: tuple[tuple[SimStream, int], ...] = ()

    def done(self, stream: SimStream, position: int) -> bool:
        """Whether work at ``position`` of ``stream`` has ended once this event has."""
        if stream is self.stream:
            return position <= self.position
        return any(other is stream and position <= upto for other, upto in self.covers)


@dataclass(frozen=True)
class Pending:
    """What a tensor made on a side stream carries until it is used: the work that made it."""

    stream: SimStream
    position: int


class ComputeClock:
    """The device's clock for the computations queued on a link's compute stream.

    Times are the host's clock less the seconds the host spent computing for the device (``lent``): the host's own
    time, the one it would have on a real GPU. A computation the host issues then starts when the device has ended
    the ones before and takes the host's time for it; its end is kept under its position on the compute stream (a
    position events and waits use, as a copy's). The host runs ahead by at most ``depth`` computations (CUDA's
    launch queue), and a host wait for computations it had not waited for is counted, and charged what they had
    left to run.
    """

    def __init__(self, stream: SimStream, depth: int) -> None:
        self.stream, self.depth = stream, depth
        self._lent = 0.0
        self._device_free = 0.0
        self._ends: deque[tuple[int, float]] = deque()  # (position, end) of computations not known ended, in order
        #: Host waits for computations issued since the host last waited (a synchronisation, an event after them, a
        #: blocking copy, a device value read): each costs a host that runs ahead of its device the lead it had.
        self.waits = 0
        #: Device seconds of computation the host waited for at those waits.
        self.wait_seconds = 0.0
        #: The least work (positions on the compute stream) the host still had queued after what one of those
        #: waits waited for: its lead over the device when it had to wait (a caller starts a count by setting it to
        #: ``depth``).
        self.least_lead = depth

    def _now(self) -> float:
        return time.monotonic() - self._lent

    def computed(self, seconds: float) -> None:
        """A computation that took the host ``seconds`` was issued on the compute stream (its position taken)."""
        self._lent += seconds
        now = self._now()
        if len(self._ends) >= self.depth:  # the launch queue is full: the host waits for its oldest (not counted)
            self._catch_up(self._ends.popleft()[1], counted=False)
        self._device_free = max(self._device_free, now) + seconds
        self.stream.queued += 1
        self._ends.append((self.stream.queued, self._device_free))

    def wait(self, position: int | None = None) -> None:
        """The host waits until the computations up to ``position`` (all: ``None``) have ended: a wait counted
        where it covers computations issued since the host last waited, charged what they had left to run."""
        end = None
        while self._ends and (position is None or self._ends[0][0] <= position):
            end = self._ends.popleft()[1]
        if end is not None:
            self.waits += 1
            self.least_lead = min(self.least_lead, self.stream.queued - (position or self.stream.queued))
            self._catch_up(end, counted=True)

    def before_copy(self, stream: SimStream, *, host_waits: bool, pinned: bool) -> None:
        """A copy is issued on ``stream``: one the host waits for (blocking, or from pageable memory on the compute
        stream, where it follows the computations) waits for the computations queued before it."""
        if host_waits or (not pinned and stream is self.stream):
            self.wait()

    def wait_for(self, event: SimEvent) -> None:
        """The host waits for ``event``: for the computations it follows too."""
        upto = event.position if event.stream is self.stream else dict(event.covers).get(self.stream, 0)
        self.wait(upto)

    def _catch_up(self, end: float, *, counted: bool) -> None:
        left = end - self._now()
        if left > 0:
            self._lent -= left  # the host's own clock moves on by the wait (it spent that time computing)
            self.wait_seconds += left * counted
