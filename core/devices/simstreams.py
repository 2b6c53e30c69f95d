"""The streams and events of the simulated GPU's link (``core.devices.simlink``), with CUDA's ordering rules.

Work queued on a stream gets a sequence number; an event records a stream's position, and how far that stream had
waited for each other one; a stream that waits on an event may use everything queued on the other stream up to that
position, and a host that waits for an event knows all that work ended.
"""

from __future__ import annotations

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
