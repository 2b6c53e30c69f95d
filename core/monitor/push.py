"""A background pusher: sends a fresh snapshot to each listener at the rate that listener asked for, and
nothing to anyone who did not ask.

Listeners subscribe with a lease (they renew it while they are open); when the last lease runs out the thread
waits without waking up, so a closed panel costs nothing. Each listener gets its own rate: one asking for ten
updates a second does not make the server send ten a second to the others. One snapshot is made per tick and
sent to every listener due then; a node that moves a model pushes at once (:meth:`Pusher.push_now`). No push samples
a model: it only reads memory figures. The pusher measures its own CPU time, so its cost can be stated rather than
guessed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("device_control")

#: A subscription lasts this many refresh intervals (at least :data:`MIN_LEASE` seconds) unless renewed.
LEASE_INTERVALS = 5
MIN_LEASE = 10.0
#: At most this many listeners are remembered; past it, the lease closest to its end is dropped.
MAX_LISTENERS = 256
#: The fastest rate anyone can ask for.
MIN_INTERVAL = 0.1


def check_interval(interval: float) -> None:
    """Raise ``ValueError`` (naming the accepted values) for a negative, NaN or infinite refresh interval."""
    if not (interval >= 0 and interval != float("inf")):
        raise ValueError(f"refresh interval {interval!r} must be 0 (off) or a number of seconds above 0.")


@dataclass
class _Lease:
    interval: float
    until: float
    due: float


class Pusher:
    """Calls ``send(snapshot(), listener)`` for each live listener, at that listener's own rate.

    Each listener (a browser tab, named by its client id) holds its own lease and rate, so one panel closing
    does not silence another, and one asking for fast updates does not speed up the others.

    Args:
        snapshot: makes the data to send (called on the pusher's thread, once per tick).
        send: delivers it to one listener (must be safe to call from another thread).
        name: the thread's name.
    """

    def __init__(
        self, snapshot: Callable[[], Any], send: Callable[[Any, str], None], name: str = "device_control.push"
    ) -> None:
        self._snapshot = snapshot
        self._send = send
        self._name = name
        self._leases: dict[str, _Lease] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._sending = threading.Lock()  # one snapshot made and sent at a time, so none overtakes a newer one
        self._cpu = 0.0
        self._active = 0.0
        self._busy_since: float | None = None
        self._pushes = 0
        self._failures = 0

    def _live(self) -> dict[str, _Lease]:
        now = time.monotonic()
        with self._lock:
            return {name: lease for name, lease in self._leases.items() if lease.until > now}

    @property
    def interval(self) -> float:
        """Seconds between two snapshots: the shortest interval a live listener asked for (1 s with none)."""
        return min((lease.interval for lease in self._live().values()), default=1.0)

    def listeners(self) -> list[str]:
        """The listeners whose subscription is alive."""
        return list(self._live())

    def listening(self) -> bool:
        """Whether a subscription is alive."""
        return bool(self._live())

    def subscribe(self, interval: float, listener: str) -> None:
        """Start or renew ``listener``'s subscription at ``interval`` seconds; ``0`` ends it.

        Raises:
            ValueError: a negative, NaN or infinite interval.
        """
        check_interval(interval)
        with self._lock:
            if interval == 0:
                self._leases.pop(listener, None)
                return
            self._renew(listener, max(MIN_INTERVAL, float(interval)))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._wake.set()

    def _renew(self, listener: str, interval: float) -> None:  # with the lock held
        now = time.monotonic()
        self._leases = {name: lease for name, lease in self._leases.items() if lease.until > now}
        if listener not in self._leases and len(self._leases) >= MAX_LISTENERS:
            del self._leases[min(self._leases, key=lambda name: self._leases[name].until)]
        until = now + max(MIN_LEASE, LEASE_INTERVALS * interval)
        previous = self._leases.get(listener)
        due = now if previous is None or previous.interval != interval else previous.due
        self._leases[listener] = _Lease(interval, until, due)

    def push_now(self) -> None:
        """Send a snapshot to every live listener now, on the caller's thread, and start their intervals again.

        For a change that the next tick could miss: a node that moves a model calls this once the move is done,
        so the panel shows the placement even when a later node undoes it before the next tick. Costs nothing
        when no one listens.
        """
        live = self._live()
        if live:
            self._push(list(live), restart=True)

    def stop(self) -> None:
        """End the thread (for tests and shutdown)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def stats(self) -> dict[str, float | int | bool]:
        """What the pusher did and what it cost: pushes, failures, CPU seconds and CPU share while listening."""
        busy = self._busy_seconds()
        return {
            "interval": self.interval,
            "listening": self.listening(),
            "listeners": len(self._live()),
            "pushes": self._pushes,
            "failures": self._failures,
            "cpu_seconds": self._cpu,
            "active_seconds": busy,
            "cpu_share": self._cpu / busy if busy > 0 else 0.0,
        }

    def _busy_seconds(self) -> float:
        return self._active + (time.monotonic() - self._busy_since if self._busy_since is not None else 0.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before the check: a subscription that comes after it sets it again
            live = self._live()
            if not live:
                self._idle()
                continue
            if self._busy_since is None:
                self._busy_since = time.monotonic()
            due = [name for name, lease in live.items() if lease.due <= time.monotonic()]
            if due:
                self._push(due)
            self._sleep_until_due()

    def _sleep_until_due(self) -> None:
        """Until the next listener is due, or a subscription changes (or the thread is stopped)."""
        upcoming = self._live()
        if upcoming:
            self._wake.wait(max(0.0, min(lease.due for lease in upcoming.values()) - time.monotonic()))

    def _idle(self) -> None:
        if self._busy_since is not None:
            self._active += time.monotonic() - self._busy_since
            self._busy_since = None
        self._wake.wait()

    def _push(self, listeners: list[str], restart: bool = False) -> None:
        """One snapshot, sent to each listener due; each one's next push is due one of its intervals later (after
        its previous due time, or after now with ``restart``)."""
        with self._sending:
            started = time.thread_time()
            try:
                data = self._snapshot()
                for listener in listeners:
                    self._send(data, listener)
                self._pushes += 1
            except Exception as exc:  # one failed snapshot must not end the panel's updates
                self._failures += 1
                log.warning("[Device Control] panel update failed (%s: %s); retrying", type(exc).__name__, exc)
            now = time.monotonic()
            with self._lock:
                for listener in listeners:
                    lease = self._leases.get(listener)
                    if lease is not None:
                        lease.due = now + lease.interval if restart else max(lease.due + lease.interval, now)
            self._cpu += time.thread_time() - started
