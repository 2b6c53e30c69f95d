"""The simulated link's host costs: issuing a copy takes host time, memory that is not pinned copies slower and
holds the host, and the host runs ahead of the device only by a bounded queue (``core.devices.sim.link``).

These drive :class:`Link` directly with tiny bandwidths, so a few kilobytes take milliseconds: long enough to
measure, short enough that each test takes a fraction of a second. Real sleeps never end early but may end late
(by tens of microseconds, more on a busy machine), so measured times are checked as "at least" the modelled time
with a generous ceiling, while the times the link books (``host_seconds``) are checked closely.
"""

from __future__ import annotations

import time

import pytest

from core.devices.sim.cost import DEFAULT_ISSUE_SECONDS, DEFAULT_QUEUE_DEPTH, PAGEABLE_RATIO, LinkCost
from core.devices.sim.link import Link, Pending
from core.errors import InvalidSizeError

GiB = 1024**3
KiB = 1024
FORM = "DEVICE_CONTROL_SIMULATE_LINK=16GB/s,10us"
#: Slack for a measured time above the modelled one: sleep overshoot, Python's own work, a busy machine.
SLACK = 0.05


def _on_side(link: Link) -> Link:
    """Make the link's side stream current in this thread (copies queued there need not hold the host)."""
    link.set_current(link.side)
    return link


# -- the setting -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", {"bandwidth": None, "latency": 0.0, "compute_speedup": 1.0, "pageable_bandwidth": None}),
        ("16GB/s,10us", {"bandwidth": 16 * GiB, "latency": 10e-6, "pageable_bandwidth": 16 * GiB * PAGEABLE_RATIO}),
        ("7GB/s", {"bandwidth": 7 * GiB, "latency": 0.0, "issue_seconds": DEFAULT_ISSUE_SECONDS}),
        ("25GB/s,10us,compute=10x", {"bandwidth": 25 * GiB, "latency": 10e-6, "compute_speedup": 10.0}),
        (
            "53GB/s,pageable=7.5GB/s,issue=5us,queue=8",
            {"pageable_bandwidth": int(7.5 * GiB), "issue_seconds": 5e-6, "queue_depth": 8, "latency": 0.0},
        ),
        (
            "1GB/s,queue=3,compute=2x,issue=1ms,2us",  # named parts and the latency in any order after the bandwidth
            {"bandwidth": GiB, "latency": 2e-6, "compute_speedup": 2.0, "issue_seconds": 1e-3, "queue_depth": 3},
        ),
        (" 1MiB/s , Issue = 0us , QUEUE=1 ", {"bandwidth": 1024**2, "issue_seconds": 0.0, "queue_depth": 1}),
    ],
)
def test_every_form_of_the_setting_is_read(text, expected):
    cost = LinkCost.parse(text)
    for name, value in expected.items():
        assert getattr(cost, name) == pytest.approx(value), name


def test_the_defaults_are_the_h100s_ratio_an_estimated_issue_cost_and_cudas_queue():
    """Pageable memory copies at 7.5/53.3 of the pinned speed (measured on an H100); a copy costs the host 10 us
    to issue (an estimate); the host may queue 1024 copies ahead. The free link costs nothing at all."""
    cost = LinkCost(bandwidth=53.3)
    assert cost.pageable_bandwidth == pytest.approx(7.5)
    assert cost.issue_seconds == DEFAULT_ISSUE_SECONDS == 10e-6 and cost.queue_depth == DEFAULT_QUEUE_DEPTH == 1024
    assert LinkCost(latency=1e-6).issue_seconds == DEFAULT_ISSUE_SECONDS  # a copy that takes time is issued
    free = LinkCost()
    assert free.free and free.issue_seconds == 0 and free.issue_time == 0 and free.seconds(GiB, pinned=False) == 0
    assert not LinkCost(issue_seconds=1e-6).free


def test_a_faster_simulated_gpu_scales_every_time_the_host_sees():
    cost = LinkCost.parse("1GiB/s,1ms,pageable=0.5GiB/s,issue=10us,compute=10x")
    assert cost.issue_time == pytest.approx(10 * 10e-6)
    assert cost.seconds(GiB) == pytest.approx(10 * 1.001)
    assert cost.seconds(GiB, pinned=False) == pytest.approx(10 * 2.001)


@pytest.mark.parametrize(
    "text",
    [
        "16GB",
        "fast",
        "xGB/s",
        "16GB/s,soon",
        "0GB/s",
        "1GB/s,1us,2",
        "1GB/s,1us,2us",
        "compute=2x",
        "issue=10us",
        "7GB/s,compute=0.5x",
        "7GB/s,compute=x",
        "7GB/s,pageable=0GB/s",
        "7GB/s,pageable=7GB",
        "7GB/s,pageable=-1GB/s",
        "7GB/s,issue=soon",
        "7GB/s,issue=10",
        "7GB/s,queue=0",
        "7GB/s,queue=1.5",
        "7GB/s,queue=many",
        "7GB/s,speed=2x",
        "7GB/s,queue=8,queue=9",
    ],
)
def test_a_malformed_link_names_the_form(text):
    with pytest.raises(InvalidSizeError, match=FORM):
        LinkCost.parse(text)


@pytest.mark.parametrize(
    "arguments",
    [{"bandwidth": 0.0}, {"pageable_bandwidth": -1.0}, {"issue_seconds": -1e-6}, {"queue_depth": 0}, {"latency": -1}],
)
def test_a_cost_made_in_code_is_checked_too(arguments):
    with pytest.raises(ValueError, match="LinkCost"):
        LinkCost(**arguments)


# -- the host's time -------------------------------------------------------------------------------------------


def test_a_pageable_copy_is_slower_than_a_pinned_one_and_holds_the_host():
    """On a side stream a pinned copy is queued and the host goes on; a pageable one goes at the pageable speed
    and the host stays until it ends (the driver stages it through a bounce buffer), whatever the caller asked."""
    cost = LinkCost(bandwidth=8 * KiB / 0.01, pageable_bandwidth=8 * KiB / 0.04, issue_seconds=0.0)  # 10 / 40 ms
    pinned = _on_side(Link(cost))
    started = time.monotonic()
    queued = pinned.copy(8 * KiB, "to_device", host_waits=False)
    assert pinned.host_seconds == 0.0  # the host went on at once; the copy ends 10 ms on
    assert 0.01 <= pinned.record(pinned.side).ready_at - started < 0.01 + SLACK

    pageable = _on_side(Link(cost))
    started = time.monotonic()
    held = pageable.copy(8 * KiB, "to_device", host_waits=False, pinned=False)
    elapsed = time.monotonic() - started
    assert 0.04 <= elapsed < 0.04 + SLACK
    assert pageable.host_wait_seconds == pytest.approx(0.04, abs=1e-6)  # booked: exactly the copy's time
    # still ordered like any side-stream copy: a tensor it made must be waited for before use
    assert isinstance(queued, Pending) and isinstance(held, Pending)


def test_a_blocking_copy_and_a_wait_on_an_event_count_as_host_time():
    link = Link(LinkCost(bandwidth=8 * KiB / 0.01, issue_seconds=0.0))  # 10 ms per copy
    link.copy(8 * KiB, "to_device", host_waits=True)
    assert link.host_wait_seconds == pytest.approx(0.01, abs=1e-6)
    _on_side(link).copy(8 * KiB, "to_device", host_waits=False)
    link.wait(link.main, link.record(link.side))  # the main stream is the host's computation: the host waits
    # Booked: the blocking copy's 10 ms and the wait for the queued copy, less the host's own time between the
    # two calls, so at least the 10 ms the host was made to wait and at most the 20 ms (a busy machine that
    # holds the thread back between the calls shortens what is left to wait for).
    assert 0.01 * 0.999 < link.host_wait_seconds <= 0.02 + 1e-9


def test_each_copy_costs_the_host_its_issue_so_one_grouped_copy_beats_many_small_ones():
    """The point of grouping weights: 50 copies of 1 KiB cost the host 50 issues, one copy of 50 KiB costs one,
    for the same bytes on the same link."""
    issue, count = 0.4e-3, 50  # each below the least sleep: the debt adds up and is paid in larger sleeps
    cost = LinkCost(bandwidth=1e12, issue_seconds=issue)  # the bytes themselves take nanoseconds

    per_tensor = _on_side(Link(cost))
    started = time.monotonic()
    for _ in range(count):
        per_tensor.copy(KiB, "to_device", host_waits=False)
    per_tensor.synchronize()  # pays whatever the host still owes
    per_tensor_elapsed = time.monotonic() - started
    assert per_tensor.host_issue_seconds == pytest.approx(count * issue)
    assert per_tensor.copies == count
    assert count * issue * 0.999 <= per_tensor_elapsed < count * issue + SLACK  # the total is paid, not lost

    grouped = _on_side(Link(cost))
    started = time.monotonic()
    grouped.copy(count * KiB, "to_device", host_waits=False)
    grouped.synchronize()
    grouped_elapsed = time.monotonic() - started
    assert grouped.host_issue_seconds == pytest.approx(issue) and grouped.host_wait_seconds == 0.0
    assert grouped_elapsed < per_tensor_elapsed / 2  # 20 ms against about 1 ms (one sleep's overshoot)


def test_the_host_runs_ahead_only_by_the_queue():
    """With two copies of 10 ms queued and not ended, a third waits for the first to end, a fourth for the
    second: 20 ms of waiting in all. With CUDA's depth the same copies are queued at once."""
    nbytes, depth = 8 * KiB, 2
    bounded = _on_side(Link(LinkCost(bandwidth=nbytes / 0.01, issue_seconds=0.0, queue_depth=depth)))
    started = time.monotonic()
    for _ in range(depth):
        bounded.copy(nbytes, "to_device", host_waits=False)
    assert bounded.host_seconds == 0.0  # room in the queue: the host goes on
    for _ in range(2):
        bounded.copy(nbytes, "to_device", host_waits=False)
    elapsed = time.monotonic() - started
    assert 0.02 * 0.999 <= elapsed < 0.02 + SLACK
    # Booked: the waits for the device, less the host's own time between the calls (and any late wake-up beyond
    # the credit a sleep's overshoot gets), so at most the 20 ms; on a busy machine that holds the thread back
    # between the calls, less (seen: 10 ms beside a ComfyUI test run), but never nothing.
    assert 0.0 < bounded.host_wait_seconds <= 0.02 + 1e-9

    deep = _on_side(Link(LinkCost(bandwidth=nbytes / 0.01, issue_seconds=0.0)))
    started = time.monotonic()
    for _ in range(depth + 2):
        deep.copy(nbytes, "to_device", host_waits=False)
    assert deep.host_seconds == 0.0 and time.monotonic() - started < 0.02  # well before the copies end
    assert 0.04 <= deep.record(deep.side).ready_at - started < 0.04 + SLACK  # the device still takes its time


def test_the_free_link_costs_nothing():
    """No bandwidth given: copies take no time and no host time, pinned or not, blocking or not, as before."""
    link = Link(LinkCost())
    started = time.monotonic()
    for i in range(500):
        link.copy(GiB, "to_device", host_waits=i % 2 == 0, pinned=i % 3 != 0)
    _on_side(link).copy(GiB, "to_device", host_waits=False, pinned=False)
    link.wait(link.main, link.record(link.side))
    link.synchronize()
    assert time.monotonic() - started < 0.1  # 500 calls of bookkeeping, nothing slept
    assert link.host_seconds == 0.0 and link.copies == 501
