"""The simulated GPU's link to the host and its streams: copies that take the time a real link would, and the host time
a real host would spend on them.

A copy costs ``latency + bytes / bandwidth`` (``DEVICE_CONTROL_SIMULATE_LINK``, e.g. ``16GB/s,10us``, read by
``core.devices.sim.cost``; unset, copies are free, as they always were). An optional part ``compute=10x`` says the
simulated GPU computes ten times faster than the host: the host cannot compute faster, so every copy (and every host
cost below) takes ten times longer instead, which keeps the ratio of copying to computing a real GPU that fast would
see (times are then host times, ten times a real GPU's). Each direction of the link is a copy engine with its own
clock, as on a PCIe GPU: a copy starts when the engine is free and ends ``cost`` later. A blocking copy makes the
host wait for its end; a copy queued on a side stream from pinned memory does not, so it overlaps the computation
that runs meanwhile on the host (the simulated GPU computes on the host, on its main stream).

The host is not free either (a first version forgot it, and predicted prefetch gains a real H100 turned into
losses): every copy costs the host time to issue (``issue=10us`` by default, an estimate); memory that is not pinned
copies slower (7.5 against 53.3 GB/s measured on an H100) and makes the host wait; the host runs ahead of the device
only by a bounded queue (``queue=1024``, CUDA's launch queue). :attr:`Link.host_seconds` adds up what it charged.

Streams keep CUDA's ordering rules, checked rather than assumed: work queued on a stream gets a sequence number; an
event records a stream's position; a stream that waits on an event may use everything queued on the other stream up
to that position. A computation on the main stream that reads a tensor a side stream made, without having waited for
it, raises :class:`MissingWaitError`: a missing wait is a test failure on a machine with no GPU, where on a real one
it would be a rare wrong image.

The simulated GPU computes on the host, so a host that waits for the device's computations would wait for nothing
here, where a real host, which runs ahead of its GPU, loses its lead: :class:`ComputeClock` keeps the time the
computations queued on the compute stream would take the device (each takes the host's time for it, the time unit of
the simulation) and what the host did meanwhile, and counts each host wait that finds computations not ended.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from .cost import LinkCost
from .host import HostReads, MissingWaitError


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


#: Host time owed below this is not slept (short sleeps overshoot): it is paid later, and overshoot credited.
_MIN_SLEEP = 0.001


class Link:
    """The link of one simulated device: its cost, its two copy engines' clocks, its streams, and the host time it
    charged.

    The host time is kept as debt per host thread (what the thread owes, in seconds from now, beyond the real time
    it spends): a copy adds its issue time and any wait to it, and it is paid by sleeping once it exceeds
    ``_MIN_SLEEP`` (at every wait on an event and every :meth:`synchronize`, whatever it is), so short costs add up
    exactly instead of each overshooting a sleep.
    """

    def __init__(self, cost: LinkCost) -> None:
        self.cost = cost
        self.main = SimStream("main", self)
        self.side = SimStream("copy", self)
        self._local = threading.local()
        self._engines = {"to_device": 0.0, "to_host": 0.0}
        self._lock = threading.Lock()
        #: Host seconds spent issuing copies (``issue_time`` per copy), over the link's life.
        self.host_issue_seconds = 0.0
        #: Host seconds spent waiting for the device: blocking and pageable copies, a full queue, events, syncs.
        self.host_wait_seconds = 0.0
        #: Copies booked over the link's life.
        self.copies = 0
        #: Times the host waited for the whole device: :meth:`synchronize`, and every blocking copy (on CUDA a
        #: stream synchronisation, which costs a host that runs ahead of the device all it had queued).
        self.synchronizations = 0
        #: Copies from memory that is not page-locked: the host waits for each, whatever the caller asked.
        self.pageable_copies = 0
        #: Host memory that copies queued without the host waiting still read (``core.devices.sim.host``).
        self.reads = HostReads()
        self.compute = ComputeClock(self.main, cost.queue_depth)  # the host runs ahead of its computations

    @property
    def host_seconds(self) -> float:
        """Host seconds the link charged: issuing copies plus waiting for the device (0 on the free link)."""
        return self.host_issue_seconds + self.host_wait_seconds

    @property
    def current(self) -> SimStream:
        """The stream work is queued on now in this thread (the main one outside :meth:`on`)."""
        return getattr(self._local, "stream", self.main)

    def set_current(self, stream: SimStream | None) -> SimStream:
        """Make ``stream`` current in this thread (``None``: the main one); return the one it replaces."""
        previous = self.current
        self._local.stream = stream or self.main
        return previous

    def copy(self, nbytes: int, direction: str, *, host_waits: bool, pinned: bool = True) -> Pending | None:
        """Book one copy of ``nbytes`` (``"to_device"`` or ``"to_host"``) on the current stream.

        The host first spends the link's issue time; if the stream already has ``queue_depth`` copies queued that
        have not ended, it then waits for the oldest to end (the bounded queue a real host runs ahead by). The
        copy starts once issued, its engine is free and its stream's earlier work is done. The host waits for its
        end when ``host_waits`` (a blocking copy) or when the memory is not ``pinned``: such a copy goes at the
        pageable bandwidth and the host stages it, so it cannot run ahead of it.

        A blocking copy is a synchronisation of the whole device: the host waits for every copy queued so far, and
        what queued copies read of host memory is then free (:attr:`reads`). Returns what a tensor made by a copy
        on a side stream must carry (``None`` on the main one).
        """
        stream = self.current
        cost = self.cost
        self.compute.before_copy(stream, host_waits=host_waits, pinned=pinned)
        self.synchronizations += host_waits
        self.pageable_copies += not pinned
        if cost.free:
            with self._lock:
                stream.queued += 1
                stream.busy_until = max(stream.busy_until, self._engines[direction])
                self.copies += 1
                position = stream.queued
            self._retire(stream, position, host_waits=host_waits, pinned=pinned)
            return None if stream is self.main else Pending(stream, position)
        now = time.monotonic()
        # The host has done what it owes (or is ahead by a sleep's overshoot), then issues this copy.
        issued = now + self._debt + cost.issue_time
        with self._lock:
            in_flight = stream.in_flight
            while in_flight and in_flight[0] <= issued:
                in_flight.popleft()
            queued_at = in_flight.popleft() if len(in_flight) >= cost.queue_depth else issued
            end = max(queued_at, self._engines[direction], stream.busy_until) + cost.seconds(nbytes, pinned=pinned)
            self._engines[direction] = end
            stream.queued += 1
            stream.busy_until = max(stream.busy_until, end)
            in_flight.append(end)
            position = stream.queued
            free_at = max(end, *self._engines.values()) if host_waits else end if not pinned else queued_at
            self.host_issue_seconds += cost.issue_time
            self.host_wait_seconds += free_at - issued
            self.copies += 1
        self._pay(free_at, _MIN_SLEEP)
        self._retire(stream, position, host_waits=host_waits, pinned=pinned)
        return None if stream is self.main else Pending(stream, position)

    def _retire(self, stream: SimStream, position: int, *, host_waits: bool, pinned: bool) -> None:
        """What the host knows ended after a copy it waited for: everything (a blocking copy), or its stream's
        earlier work (a pageable one, which CUDA starts only once its stream is idle)."""
        if host_waits:
            self.reads.retire_all()
        elif not pinned:
            self.reads.retire(lambda other, at: other is stream and at < position)

    def record(self, stream: SimStream) -> SimEvent:
        """An event at ``stream``'s current position."""
        with self._lock:
            return SimEvent(stream, stream.queued, stream.busy_until, tuple(stream.synced.items()))

    def wait_host(self, event: SimEvent | None) -> None:
        """The host waits until the work ``event`` marks has ended (after paying what it owes); the host memory
        copies up to it read is then free (:attr:`reads`: raises if the host wrote to it before)."""
        if event is None:
            return
        self.compute.wait_for(event)
        self._wait_until(event.ready_at)
        self.reads.retire(event.done)

    def wait(self, stream: SimStream, event: SimEvent) -> None:
        """Order ``stream`` after ``event``. The main stream is the host's computation, so the host waits (after
        paying what it owes)."""
        with self._lock:
            stream.synced[event.stream] = max(stream.synced.get(event.stream, 0), event.position)
            stream.busy_until = max(stream.busy_until, event.ready_at)
        if stream is self.main:
            self._wait_until(event.ready_at)

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
        """Wait on the host until every copy queued so far has ended, and pay all the host time owed."""
        with self._lock:
            end = max(self._engines.values())
            self.synchronizations += 1
        self.compute.wait()
        self._wait_until(end)
        self.reads.retire_all()

    @property
    def _debt(self) -> float:
        """Host seconds this thread owes beyond the real time it has spent (negative: a sleep's overshoot)."""
        return getattr(self._local, "debt", 0.0)

    def _wait_until(self, deadline: float) -> None:
        """The host waits for the device until ``deadline`` (monotonic), after the work it owes; nothing is left
        owed afterwards."""
        if self.cost.free:
            _sleep_until(deadline, 0.0)
            return
        owed_until = time.monotonic() + self._debt
        with self._lock:
            self.host_wait_seconds += max(deadline - owed_until, 0.0)
        self._pay(max(deadline, owed_until), 0.0)

    def _pay(self, free_at: float, least: float) -> None:
        """Make this thread's host free at ``free_at`` (monotonic): sleep until then if more than ``least`` seconds
        are left, else carry them as debt. A sleep's overshoot is carried as credit (at most ``_MIN_SLEEP``, so
        that a stall of the process is not paid back), which keeps the total exact."""
        left = free_at - time.monotonic()
        if left > least:
            time.sleep(left)
            left = free_at - time.monotonic()
        self._local.debt = max(left, -_MIN_SLEEP)


def _sleep_until(deadline: float, least: float) -> None:
    """Sleep until ``deadline`` (monotonic), unless less than ``least`` seconds are left."""
    left = deadline - time.monotonic()
    if left > least:
        time.sleep(left)
