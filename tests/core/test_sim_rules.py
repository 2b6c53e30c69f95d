"""The simulated GPU fails where CUDA fails: each rule driven through the backend, as the engine drives it
(``backend_of(target).pin/copy_into/record/wait/...``), and each shown to fail on a deliberately wrong use.

Rules (``core.devices.sim.host``, ``core.devices.sim.link``, ``core.devices.sim.device``): host registration is
page-granular and its failure stays pending until read back; a copy from pageable memory holds the host; a blocking
copy waits for the whole device; a ring slot is read only after its copy's event was waited for, and host memory a
queued copy reads is neither written nor freed before the host waited for that copy; a view of a larger host block
moved in place is booked for its own bytes.
"""

from __future__ import annotations

import contextlib
import gc
import math
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from core.devices.backends import HOST, backend_of
from core.devices.host_memory import page_size
from core.devices.pinned import PinnedMemory
from core.devices.sim.cost import LinkCost
from core.devices.sim.device import SimulatedDevice
from core.devices.sim.host import REGISTRY, MissingWaitError, PendingDeviceError
from tests.core.platform_marks import STREAMS_AND_PINNING

MiB = 1024**2
KiB = 1024


@pytest.fixture
def device() -> SimulatedDevice:
    return SimulatedDevice(64 * MiB)


@pytest.fixture(autouse=True)
def no_error_left():
    """Each test starts and ends with no registration error pending in this thread (it is the process's)."""
    assert REGISTRY.take_error() is None
    yield
    assert REGISTRY.take_error() is None, "a test left a registration error pending"


def pages(count: int) -> torch.Tensor:
    """``count`` whole pages of host memory, starting on a page."""
    raw = torch.zeros((count + 1) * page_size(), dtype=torch.uint8)
    return raw.narrow(0, -raw.data_ptr() % page_size(), count * page_size())


def pin(backend, tensor: torch.Tensor) -> bool:
    return backend.pin(tensor.data_ptr(), tensor.numel() * tensor.element_size())


# -- host registration is page-granular, and its failure stays pending -----------------------------------------


@STREAMS_AND_PINNING
def test_a_range_touching_a_registered_page_fails_and_the_next_kernel_raises_cudas_error(device):
    backend, memory = backend_of(device), pages(4)
    weight = device.place(torch.ones(8))
    first, same_page = memory[:100], memory[1000:2000]  # two tensors packed apart, on one page
    assert pin(backend, first)
    try:
        assert not pin(backend, same_page)  # CUDA: cudaErrorHostMemoryAlreadyRegistered
        with pytest.raises(PendingDeviceError, match="part or all of the requested memory range is already mapped"):
            weight * 2  # the next kernel reports the registration's error as its own
        assert torch.equal(weight * 2, torch.full((8,), 2.0))  # raised once: reading it cleared it
    finally:
        backend.unpin(first.data_ptr())


@STREAMS_AND_PINNING
def test_the_pending_error_reaches_the_next_copy_too_and_take_error_clears_it(device):
    backend, memory = backend_of(device), pages(2)
    assert pin(backend, memory[: page_size() + 1])  # reaches into the second page
    try:
        assert not pin(backend, memory[page_size() + 8 :])
        with pytest.raises(PendingDeviceError, match="already mapped"):
            backend.copy_to(torch.ones(4), device)
        assert not pin(backend, memory[page_size() + 8 :])
        assert "already mapped" in backend.take_error()  # what the engine calls right after a failed pin
        assert backend.take_error() is None
        assert torch.equal(backend.copy_to(torch.ones(4), device) + 1, torch.full((4,), 2.0))  # nothing pending
    finally:
        backend.unpin(memory.data_ptr())


@STREAMS_AND_PINNING
def test_ranges_on_pages_of_their_own_register_and_unpinning_frees_the_pages(device):
    backend, memory = backend_of(device), pages(3)
    low, high = memory[: page_size()], memory[page_size() : 3 * page_size()]
    assert pin(backend, low) and pin(backend, high)  # adjacent, no page shared
    assert backend.is_pinned(memory[page_size() + 10 : page_size() + 20])  # a view inside a registered range
    assert not backend.is_pinned(memory[page_size() - 10 : page_size() + 10])  # across two ranges: not one registration
    backend.unpin(low.data_ptr())
    assert not backend.is_pinned(low) and pin(backend, memory[100:200])  # its page is free again
    backend.unpin(memory[100:200].data_ptr())
    backend.unpin(high.data_ptr())
    assert pin(backend, memory) and backend.is_pinned(memory)
    backend.unpin(memory.data_ptr())


@STREAMS_AND_PINNING
def test_unpinning_what_was_never_registered_leaves_an_error_pending(device):
    backend = backend_of(device)
    backend.unpin(pages(1).data_ptr())
    assert "not correspond to a registered memory region" in backend.take_error()


@STREAMS_AND_PINNING
def test_the_pending_error_is_the_failing_threads_own(device):
    backend, memory = backend_of(device), pages(1)
    assert pin(backend, memory[:10])
    errors: list[str | None] = []
    try:
        other = threading.Thread(target=lambda: errors.append(pin(backend, memory[20:30]) or backend.take_error()))
        other.start()
        other.join()
        assert "already mapped" in errors[0] and REGISTRY.take_error() is None  # this thread has none
    finally:
        backend.unpin(memory.data_ptr())


@STREAMS_AND_PINNING
def test_pinned_memory_reads_a_failed_registrations_error_back_so_no_kernel_raises_it(device):
    """ComfyUI (or anyone) locked part of a page; our lock of a range on that page fails, and PinnedMemory reads the
    error back at once, so the forward that follows runs."""
    backend, memory = backend_of(device), pages(2)
    weight = device.place(torch.ones(8))
    assert pin(backend, memory[:64])  # someone else's registration
    try:
        assert not PinnedMemory(max_bytes=MiB).lock(memory[64:], device)
        assert torch.equal(weight * 2, torch.full((8,), 2.0))
    finally:
        backend.unpin(memory.data_ptr())


# -- pageable copies hold the host; blocking copies wait for the whole device ---------------------------------


def costed(milliseconds_per_8k: float) -> SimulatedDevice:
    cost = LinkCost(bandwidth=8 * KiB / (milliseconds_per_8k / 1000), issue_seconds=0.0)
    return SimulatedDevice(64 * MiB, link=cost)


@STREAMS_AND_PINNING
def test_a_copy_from_pageable_memory_holds_the_host_even_when_non_blocking_is_asked():
    device = costed(10.0)
    backend, link = backend_of(device), device.link
    memory = pages(2)
    assert pin(backend, memory)
    try:
        with backend.on_stream(backend.side_stream(device)):
            backend.copy_to(memory, device, non_blocking=True)  # pinned: queued, the host goes on
            assert link.host_wait_seconds == 0.0 and link.pageable_copies == 0
            backend.copy_to(torch.zeros(8 * KiB, dtype=torch.uint8), device, non_blocking=True)  # pageable
        assert link.pageable_copies == 1 and link.host_wait_seconds >= 0.01 * 53.3 / 7.5  # its time at 7.5 GB/s
        link.synchronize()
    finally:
        backend.unpin(memory.data_ptr())


@STREAMS_AND_PINNING
def test_a_pageable_copy_into_a_ring_slot_holds_the_host():
    device = costed(10.0)
    backend, link = backend_of(device), device.link
    slot = backend.empty(device, torch.Size([8 * KiB]), torch.uint8)
    with backend.on_stream(backend.side_stream(device)):
        backend.copy_into(slot, torch.ones(8 * KiB, dtype=torch.uint8), non_blocking=True)
    assert link.pageable_copies == 1 and link.host_wait_seconds > 0.01  # 10 ms pinned; slower from pageable


@STREAMS_AND_PINNING
def test_a_blocking_copy_waits_for_everything_queued_on_the_device_and_counts_as_a_synchronisation():
    device = costed(20.0)
    backend, link = backend_of(device), device.link
    memory = pages(2)
    slot = backend.empty(device, torch.Size([memory.numel()]), torch.uint8)
    assert pin(backend, memory)
    try:
        synchronizations = link.synchronizations  # the slot's allocation was booked as a loader's blocking fill
        with backend.on_stream(backend.side_stream(device)):
            backend.copy_into(slot, memory, non_blocking=True)  # 20 ms, queued
        assert link.synchronizations == synchronizations
        started = time.monotonic()
        backend.copy_to(torch.zeros(16, dtype=torch.uint8), device)  # tiny, blocking, on the compute stream
        assert time.monotonic() - started >= 0.015  # it waited for the queued copy, not only for itself
        assert link.synchronizations == synchronizations + 1
        link.synchronize()
        assert link.synchronizations == synchronizations + 2
    finally:
        backend.unpin(memory.data_ptr())


# -- stream order: ring slots, and the host memory queued copies read ------------------------------------------


@contextlib.contextmanager
def pinned_slot(device: SimulatedDevice, count: int) -> Iterator[tuple]:
    """``count`` page-locked pages of host memory and a device buffer of their size: (backend, pages, buffer)."""
    backend, memory = backend_of(device), pages(count)
    slot = backend.empty(device, torch.Size([memory.numel()]), torch.uint8)
    assert pin(backend, memory)
    try:
        yield backend, memory, slot
    finally:
        backend.unpin(memory.data_ptr())


def fill(device: SimulatedDevice, slot: torch.Tensor, source: torch.Tensor, *, after_reads: bool = True):
    """``source`` copied into ``slot`` on the side stream, non-blocking, as the ring fills a slot (after the compute
    stream's reads of its old contents, unless told otherwise); the copy's event."""
    backend = backend_of(device)
    side = backend.side_stream(device)
    released = backend.record(backend.current_stream(device))
    with backend.on_stream(side):
        if after_reads:
            backend.wait(side, released)
        backend.copy_into(slot, source, non_blocking=True)
        return backend.record(side)


@STREAMS_AND_PINNING
def test_a_kernel_reading_a_ring_slot_before_its_copys_event_was_waited_for_raises(device):
    backend, memory = backend_of(device), pages(1)
    memory.fill_(3)
    slot = backend.empty(device, torch.Size([page_size()]), torch.uint8)
    assert pin(backend, memory)
    try:
        event = fill(device, slot, memory)
        with pytest.raises(MissingWaitError, match="without waiting for that copy"):
            slot[:4] + 1
        backend.wait(backend.current_stream(device), event)
        assert torch.equal(slot[:4] + 1, torch.full((4,), 4, dtype=torch.uint8))
        backend.wait_host(event)
    finally:
        backend.unpin(memory.data_ptr())


@STREAMS_AND_PINNING
def test_a_copy_overwriting_a_slot_before_the_reads_of_its_old_contents_raises(device):
    with pinned_slot(device, 1) as (backend, memory, slot):
        backend.wait(backend.current_stream(device), fill(device, slot, memory))
        slot.sum()  # the compute stream reads the slot
        with pytest.raises(MissingWaitError, match="overwrote a buffer"):
            fill(device, slot, memory, after_reads=False)  # the side stream did not wait for that read
        backend.wait_host(fill(device, slot, memory))


@STREAMS_AND_PINNING
def test_the_host_writing_to_memory_a_queued_copy_still_reads_raises_when_it_waits(device):
    with pinned_slot(device, 2) as (backend, memory, slot):
        event = fill(device, slot, memory)
        memory[page_size() :].fill_(7)  # wrong: the copy may still be reading it on a real GPU
        with pytest.raises(MissingWaitError, match="wrote to host memory a queued copy still read"):
            backend.wait_host(event)
        event = fill(device, slot, memory)
        backend.wait_host(event)
        memory.fill_(9)  # right: the host waited for the copy first
        fill(device, slot, memory)
        backend.synchronize(device)  # a whole-device wait frees the sources too
        memory.fill_(1)


@STREAMS_AND_PINNING
def test_a_host_wait_on_an_event_of_a_stream_that_waited_for_the_copy_frees_its_source(device):
    with pinned_slot(device, 1) as (backend, memory, slot):
        compute = backend.current_stream(device)
        backend.wait(compute, fill(device, slot, memory))
        slot.sum()
        backend.wait_host(backend.record(compute))  # covers the copy the compute stream waited for
        memory.fill_(5)
        fill(device, slot, memory)
        compute_event = backend.record(compute)  # recorded before the compute stream waited for the new copy
        memory.fill_(6)
        backend.wait_host(compute_event)  # does not cover the new copy: its source is still read
        with pytest.raises(MissingWaitError, match="wrote to host memory"):
            backend.synchronize(device)


@STREAMS_AND_PINNING
def test_freeing_memory_a_queued_copy_still_reads_raises_at_the_next_operation_on_the_device(device):
    backend = backend_of(device)
    weight = device.place(torch.ones(8))
    slot = backend.empty(device, torch.Size([page_size()]), torch.uint8)
    memory = pages(1)
    pointer = memory.data_ptr()
    assert pin(backend, memory)
    fill(device, slot, memory)
    del memory
    gc.collect()  # freed: a real GPU's copy may still be reading it
    with pytest.raises(MissingWaitError, match="was freed before the host waited"):
        weight * 2
    assert torch.equal(weight * 2, torch.full((8,), 2.0))  # reported once
    backend.unpin(pointer)  # what was freed is not reported again as unlocked
    assert torch.equal(weight * 2, torch.full((8,), 2.0))
    memory = pages(1)
    assert pin(backend, memory)
    backend.wait_host(fill(device, slot, memory))
    backend.unpin(memory.data_ptr())
    del memory
    gc.collect()
    weight * 2  # waited for first: nothing to report


# -- a view of a larger host block moved in place is booked for its own bytes ---------------------------------


def test_a_weight_that_is_a_view_of_a_slab_is_booked_for_its_own_bytes_when_moved_in_place(device):
    backend = backend_of(device)
    slab = torch.arange(MiB // 4, dtype=torch.float32)  # 1 MiB
    layer = torch.nn.Linear(256, 256)
    layer.weight.data = slab[1024 : 1024 + 256 * 256].view(256, 256)
    layer.bias.data = slab[70000:70256]
    for tensor in (layer.weight, layer.bias):
        backend.adopt(tensor, device)
    assert device.allocated() == (256 * 256 + 256) * 4  # CUDA allocates the views, not the 1 MiB slab
    assert torch.equal(layer.weight.as_subclass(torch.Tensor)[0, :3], torch.tensor([1024.0, 1025.0, 1026.0]))
    assert isinstance(layer.weight, torch.nn.Parameter) and layer.weight.data_ptr() == slab[1024:].data_ptr()
    for tensor in (layer.weight, layer.bias):
        backend_of(HOST).adopt(tensor, HOST)
    gc.collect()
    assert device.allocated() == 0


@STREAMS_AND_PINNING
@pytest.mark.parametrize("path", ["slot", "tensor"])
def test_unlocking_memory_a_queued_copy_still_reads_raises_at_the_next_operation_on_the_device(device, path):
    """Unlocked, the pages a queued copy reads may move (on every path that queues one: a ring's slot, a tensor
    moved on its own, a LoRA factor); once the host waited for the copy, unlocking is free."""
    backend = backend_of(device)
    weight = device.place(torch.ones(8))
    slot = backend.empty(device, torch.Size([page_size()]), torch.uint8)
    memory = pages(1)
    assert pin(backend, memory)
    with backend.on_stream(backend.side_stream(device)):
        if path == "slot":
            fill(device, slot, memory)
        else:
            backend.copy_to(memory, device, non_blocking=True)
    backend.unpin(memory.data_ptr())
    with pytest.raises(MissingWaitError, match="was unlocked before the host waited"):
        weight * 2
    assert pin(backend, memory)
    with backend.on_stream(backend.side_stream(device)):
        backend.copy_to(memory, device, non_blocking=True)
    backend.synchronize(device)
    backend.unpin(memory.data_ptr())
    assert torch.equal(weight * 2, torch.full((8,), 2.0))


# -- the device's clock: the host runs ahead of the computations, and a wait for them is counted and charged ------


def test_a_host_wait_for_computations_is_counted_and_charged_what_they_had_left_to_run():
    """The simulated GPU computes on the host; its clock counts that time as the device's, so a host that waits
    right after issuing a computation is charged about its time, one that did as much work of its own first is not,
    and a wait that covers no new computation is not counted."""
    device = SimulatedDevice(256 * MiB)
    clock = device.link.compute
    a = device.place(torch.randn(768, 768))
    started = time.monotonic()
    b = a @ a @ a @ a
    took = time.monotonic() - started
    device.link.synchronize()
    assert clock.waits == 1 and 0.25 * took <= clock.wait_seconds <= took + 0.01
    device.link.synchronize()
    assert clock.waits == 1  # nothing new to wait for
    c = b @ a
    time.sleep(2 * took + 0.01)  # the host's own work: the device ended meanwhile
    charged = clock.wait_seconds
    assert math.isfinite(c.sum().item())  # a value read: counted, charged the sum's time only
    assert clock.waits == 2 and clock.wait_seconds - charged < 0.3 * took
