"""The panel's pusher: pushes while a subscription lives, stops without one, survives a failing snapshot."""

from __future__ import annotations

import threading
import time

import pytest

from core.monitor import push
from core.monitor.push import Pusher


def wait_for(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


@pytest.fixture
def sent():
    return []


@pytest.fixture
def pusher(sent):
    counter = iter(range(10**9))
    pusher = Pusher(lambda: next(counter), lambda data, _listener: sent.append(data))
    yield pusher
    pusher.stop()


def test_nothing_is_sent_until_someone_subscribes(pusher, sent):
    time.sleep(0.2)
    assert sent == [] and not pusher.listening()


def test_pushes_at_the_chosen_rate_and_stops_when_unsubscribed(pusher, sent):
    pusher.subscribe(0.1, "tab")
    assert wait_for(lambda: len(sent) >= 5)
    pusher.subscribe(0, "tab")
    time.sleep(0.15)
    count = len(sent)
    time.sleep(0.4)
    assert len(sent) == count and not pusher.listening()
    assert sent[:5] == [0, 1, 2, 3, 4]


def test_a_lease_that_is_not_renewed_runs_out(pusher, sent, monkeypatch):
    monkeypatch.setattr(push, "MIN_LEASE", 0.3)
    pusher.subscribe(0.1, "tab")
    assert wait_for(lambda: len(sent) >= 2)
    time.sleep(0.8)  # the lease (max(0.3 s, 5 intervals) = 0.5 s) has run out
    count = len(sent)
    time.sleep(0.3)
    assert len(sent) == count


def test_a_failing_snapshot_is_counted_and_the_next_one_goes_out(sent):
    calls = iter(range(10**9))

    def flaky():
        n = next(calls)
        if n == 0:
            raise RuntimeError("device query failed")
        return n

    pusher = Pusher(flaky, lambda data, _listener: sent.append(data))
    try:
        pusher.subscribe(0.1, "tab")
        assert wait_for(lambda: len(sent) >= 2)
        assert pusher.stats()["failures"] == 1
    finally:
        pusher.stop()


def test_stats_measure_the_threads_cpu_share(pusher):
    pusher.subscribe(0.1, "tab")
    time.sleep(0.5)
    stats = pusher.stats()
    assert stats["pushes"] >= 3 and stats["listening"] is True
    assert 0 <= stats["cpu_share"] < 0.5 and stats["active_seconds"] > 0.3


@pytest.mark.parametrize("interval", [-1, float("nan"), float("inf")])
def test_a_bad_interval_is_refused(pusher, interval):
    with pytest.raises(ValueError, match="0 \\(off\\) or a number of seconds"):
        pusher.subscribe(interval, "tab")


def test_sending_happens_on_the_pushers_own_thread(sent):
    threads = []
    pusher = Pusher(
        lambda: threading.current_thread().name, lambda data, _: threads.append(data), name="device_control.push"
    )
    try:
        pusher.subscribe(0.1, "tab")
        assert wait_for(lambda: threads)
        assert threads[0] == "device_control.push"
    finally:
        pusher.stop()


def test_one_listener_leaving_does_not_silence_another(pusher, sent):
    pusher.subscribe(5, "tab-a")
    pusher.subscribe(0.1, "tab-b")
    assert pusher.interval == 0.1  # the fastest rate asked for
    pusher.subscribe(0, "tab-b")
    assert pusher.listening() and pusher.interval == 5
    pusher.subscribe(0, "tab-a")
    assert not pusher.listening() and pusher.stats()["listeners"] == 0


def test_listeners_are_bounded(pusher, monkeypatch):
    monkeypatch.setattr(push, "MAX_LISTENERS", 3)
    for n in range(10):
        pusher.subscribe(60, f"tab-{n}")
    assert pusher.stats()["listeners"] == 3


def test_each_listener_gets_its_own_rate_and_only_what_it_asked_for():
    received: dict[str, int] = {}

    def send(_data, listener):
        received[listener] = received.get(listener, 0) + 1

    pusher = Pusher(lambda: "snapshot", send)
    try:
        pusher.subscribe(0.1, "fast")
        pusher.subscribe(1.0, "slow")
        time.sleep(1.55)
        assert received["fast"] >= 10 and 1 <= received["slow"] <= 3  # the fast one does not speed the slow one
        assert set(received) == {"fast", "slow"}  # nobody else is sent anything
    finally:
        pusher.stop()


def test_push_now_sends_nothing_without_a_listener(pusher, sent):
    pusher.push_now()
    assert sent == []


def test_push_now_sends_to_every_listener_at_once_and_restarts_their_interval():
    received: list[tuple[str, str]] = []
    pusher = Pusher(lambda: threading.current_thread().name, lambda data, listener: received.append((listener, data)))
    try:
        pusher.subscribe(1.0, "a")
        pusher.subscribe(2.0, "b")
        assert wait_for(lambda: {listener for listener, _ in received} == {"a", "b"})  # the first ticks
        received.clear()
        pusher.push_now()
        assert sorted(received) == [("a", "MainThread"), ("b", "MainThread")]  # on the caller's thread, now
        time.sleep(0.6)
        assert len(received) == 2  # the next tick waits a whole interval after the push
    finally:
        pusher.stop()


def test_a_push_never_overtakes_a_newer_one():
    """A tick's snapshot made before a move must not reach the panel after the snapshot ``push_now`` made after it."""
    counter = iter(range(10**9))
    received: list[int] = []

    def snapshot() -> int:
        n = next(counter)
        if threading.current_thread().name == "device_control.push":
            time.sleep(0.05)  # the tick's snapshot is slow: a push_now meanwhile would finish first
        return n

    pusher = Pusher(snapshot, lambda data, _: received.append(data))
    try:
        pusher.subscribe(0.1, "tab")
        for _ in range(10):
            time.sleep(0.12)  # the tick comes due meanwhile
            pusher.push_now()
        assert received == sorted(received) and len(received) >= 15
    finally:
        pusher.stop()
