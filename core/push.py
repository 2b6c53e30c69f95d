"""A background pusher: sends a fresh snapshot at a set rate while someone listens, and nothing otherwise.

Listeners subscribe with a lease (they renew it while they are open); when the last lease runs out the thread
waits without waking up, so a closed panel costs nothing. The thread is never the one that samples a model:
it only reads memory figures. It measures its own CPU time, so its cost can be stated rather than guessed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("device_control")

#: A subscription lasts this many refresh intervals (at least :data:`MIN_LEASE` seconds) unless renewed.
LEASE_INTERVALS = 5
MIN_LEASE = 10.0
#: At most this many listeners are remembered; past it, the lease closest to its end is dropped.
MAX_LISTENERS = 256
#: The fastest rate anyone can ask for.
MIN_INTERVAL = 0.1


class Pusher:
    """Calls ``send(snapshot())`` while a subscription is alive, at the fastest rate a listener asked for.

    Each listener (a browser tab, named by its client id) holds its own lease, so one panel closing does not
    silence another.

    Args:
        snapshot: makes the data to send (called on the pusher's thread).
        send: delivers it (must be safe to call from another thread).
        name: the thread's name.
    """

    def __init__(self, snapshot: Callable[[], Any], send: Callable[[Any], None], name: str = "device_control.push"):
        self._snapshot = snapshot
        self._send = send
        self._name = name
        self._leases: dict[str, tuple[float, float]] = {}  # listener -> (interval, lease end)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._cpu = 0.0
        self._active = 0.0
        self._busy_since: float | None = None
        self._pushes = 0
        self._failures = 0

    def _live(self) -> list[float]:
        now = time.monotonic()
        with self._lock:
            return [interval for interval, until in self._leases.values() if until > now]

    @property
    def interval(self) -> float:
        """Seconds between two pushes: the shortest interval a live listener asked for (1 s with none)."""
        return min(self._live(), default=1.0)

    def listening(self) -> bool:
        """Whether a subscription is alive."""
        return bool(self._live())

    def subscribe(self, interval: float, listener: str = "") -> None:
        """Start or renew ``listener``'s subscription at ``interval`` seconds; ``0`` ends it.

        Raises:
            ValueError: a negative, NaN or infinite interval.
        """
        if not (interval >= 0 and interval != float("inf")):
            raise ValueError(f"refresh interval {interval!r} must be 0 (off) or a number of seconds above 0.")
        with self._lock:
            if interval == 0:
                self._leases.pop(listener, None)
                return
            interval = max(MIN_INTERVAL, float(interval))
            now = time.monotonic()
            self._leases = {k: v for k, v in self._leases.items() if v[1] > now}
            if listener not in self._leases and len(self._leases) >= MAX_LISTENERS:
                del self._leases[min(self._leases, key=lambda k: self._leases[k][1])]
            self._leases[listener] = (interval, now + max(MIN_LEASE, LEASE_INTERVALS * interval))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._wake.set()

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
            if not self.listening():
                if self._busy_since is not None:
                    self._active += time.monotonic() - self._busy_since
                    self._busy_since = None
                self._wake.wait()
                continue
            if self._busy_since is None:
                self._busy_since = time.monotonic()
            started = time.thread_time()
            try:
                self._send(self._snapshot())
                self._pushes += 1
            except Exception as exc:  # one failed snapshot must not end the panel's updates
                self._failures += 1
                log.warning("[Device Control] panel update failed (%s: %s); retrying", type(exc).__name__, exc)
            self._cpu += time.thread_time() - started
            self._stop.wait(self.interval)
