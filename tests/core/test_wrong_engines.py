"""Each rule of the simulated GPU keeps a deliberately wrong engine that must fail it: the real engine with one
step left out. A rule that stops failing its wrong engine no longer guards anything, and this module says so.

Rules here: the host memory a queued copy reads is neither unlocked nor freed before the host waited for the copy
(``core.devices.sim.host``), on every path that queues one; a steady streamed pass never makes the host wait for the
device's computations (``core.devices.sim.link.ComputeClock``: the host runs ahead of a real GPU, and each such
wait costs it its lead), and one from pageable slabs keeps the staging pool's groups queued when it waits; a tensor
takes a caching allocator's block, not its bytes (``core.devices.allocator``), so room kept for a decode's
temporaries in exact bytes is short.
"""

from __future__ import annotations

import gc

import pytest
import torch

from core.detection.ggml_types import GGML_TYPES
from core.devices.backends import backend_of
from core.devices.pinned import pinned_memory
from core.devices.sim.cost import LinkCost
from core.devices.sim.device import SimulatedDevice
from core.devices.sim.host import MissingWaitError
from core.placement import ring as ring_module
from core.placement.engine import partial_model_of
from core.placement.ring import Ring
from core.placement.staging import STAGING_BUFFERS
from core.weights import ggml_blocks
from tests.core.order_net import streamed_net
from tests.core.platform_marks import STREAMS_AND_PINNING

#: A link whose copies take time, so that the ring's last fills are still in flight when a pass ends.
SLOW_LINK = LinkCost(bandwidth=2e9, latency=1e-4)


def _settle_without_waiting(ring: Ring) -> None:
    """The wrong engine: sampling ended, and the ring frees its slots without waiting for the copies in flight."""
    for _module, member in ring._members:
        member.views = []
    ring._reset_ring()


@STREAMS_AND_PINNING
@pytest.mark.parametrize("engine", ["right", "unlocks before its copies end"])
def test_unlocking_slabs_before_the_copies_that_read_them_end_fails(monkeypatch, engine):
    net, device, x = streamed_net(link=SLOW_LINK)
    ring = partial_model_of(net).ring
    if engine != "right":
        monkeypatch.setattr(Ring, "settle", _settle_without_waiting)
    with torch.no_grad():
        out = net(device.place(x))
    assert any(slab.pinned for slab in ring._slabs)  # locked slabs, read by queued copies
    ring.detach()  # the model leaves the device: its slabs are unlocked
    gc.collect()
    if engine == "right":
        assert torch.isfinite(out * 1).all()
    else:
        with pytest.raises(MissingWaitError, match="unlocked before the host waited"):
            out * 1


@STREAMS_AND_PINNING
def test_slabs_are_unlocked_only_after_the_copies_of_layers_that_copy_their_own_tensors_end():
    """A ring without room: each streamed layer copies its own tensors from the locked slabs (the per-tensor path);
    the model then leaves the device, and its slabs are unlocked only once those copies ended."""
    net, device, x = streamed_net(link=SLOW_LINK)
    engine = partial_model_of(net)
    x = device.place(x)
    slot = max(group.nbytes for group in engine.ring._groups)
    blocker = device.place(torch.empty(device.free() - slot + 512, dtype=torch.uint8))  # no room for a slot
    with torch.no_grad():
        out = net(x)
    assert engine.ring.ring_bytes == 0 and any(slab.pinned for slab in engine.ring._slabs)
    engine.ring.detach()
    del blocker
    gc.collect()
    assert torch.isfinite(out * 1).all()


def _enter_after_synchronising(enter):
    """The wrong engine: each group entered after a synchronisation of the whole device."""

    def enter_after(ring: Ring, group: int, target: object) -> bool:
        backend_of(ring.target).synchronize(ring.target)
        return enter(ring, group, target)

    return enter_after


def _steady_compute_waits() -> tuple[int, int]:
    """Host waits for the device's computations in three steady passes of a streamed net (after a first pass that
    learns the order and a second that allocates the ring), and the groups those passes entered."""
    net, device, x = streamed_net(resident_layers=0, link=SLOW_LINK)
    ring = partial_model_of(net).ring
    x = device.place(x)
    with torch.no_grad():
        net(x), net(x)
        before = device.link.compute.waits
        for _pass in range(3):
            out = net(x)
    waits = device.link.compute.waits - before
    assert ring.stats.staged == 0  # locked slabs: none staged
    assert torch.isfinite(out.cpu()).all()  # a value read: the host waits for the device (after the count)
    return waits, 3 * len(ring._groups)


@STREAMS_AND_PINNING
@pytest.mark.parametrize("engine", ["right", "synchronises at every group"])
def test_a_steady_streamed_pass_from_locked_slabs_never_waits_for_the_devices_computations(monkeypatch, engine):
    """Locked slabs cross on the side stream, ordered by events: the host runs ahead of the device's computations
    and never waits for them; an engine that synchronises the device at every group waits at every group."""
    if engine != "right":
        monkeypatch.setattr(Ring, "_enter", _enter_after_synchronising(Ring._enter))
    waits, groups = _steady_compute_waits()
    assert waits == 0 if engine == "right" else waits >= groups, waits


@STREAMS_AND_PINNING
@pytest.mark.parametrize("engine", ["right", "a staging buffer a slot"])
def test_a_steady_streamed_pass_from_pageable_slabs_keeps_the_host_a_staging_pool_ahead(monkeypatch, engine):
    """Pageable slabs cross through the ring's page-locked staging buffers: before it writes a buffer again the
    host waits for the copy that last read it, which followed the computations before it. With a buffer a slot
    (the wrong engine, as the ring was) the host ran two groups ahead of the device at those waits, so a device with
    little queued went idle while the host copied the next group; with a pool of buffers apart from the slots
    (``STAGING_AHEAD_BYTES``, at most ``STAGING_BUFFERS``, at most the ring's groups) it keeps a pool's worth of
    groups queued, and waits at most once a group (issue 57, item 6)."""
    monkeypatch.setattr(pinned_memory(), "max_bytes", 0)
    if engine != "right":
        monkeypatch.setattr(ring_module, "pool_size", lambda slots, groups, nbytes: slots)
    net, device, x = streamed_net(resident_layers=0, link=SLOW_LINK)
    ring, clock = partial_model_of(net).ring, device.link.compute
    x = device.place(x)
    with torch.no_grad():
        net(x), net(x)
        clock.least_lead, waits, issued = clock.depth, clock.waits, clock.stream.queued
        for _pass in range(3):
            net(x)
        per_group = (clock.stream.queued - issued) / (3 * len(ring._groups))  # a group's work on the stream
        waits, lead = clock.waits - waits, clock.least_lead
    pool = min(STAGING_BUFFERS, len(ring._groups))
    assert ring.stats.staged == ring.stats.copies and pool > ring.slots
    assert 0 < waits <= 3 * len(ring._groups), waits
    if engine == "right":
        assert len(ring._staging._blocks) == pool and lead >= (pool - 1) * per_group, (lead, per_group)
    else:
        assert lead <= ring.slots * per_group, (lead, per_group)


@pytest.mark.parametrize("engine", ["right", "counts exact bytes"])
def test_room_for_a_decode_counted_in_exact_bytes_is_short_of_the_allocators_blocks(monkeypatch, engine):
    """A Q4_0 weight of more than 1 MiB decoded into bf16 (its result, a float32 chunk and the chunk's fields): the
    simulated GPU books each tensor in the most its caching allocator's block takes, and the room the plan keeps
    (``decode_bytes``) must hold it; counted in exact bytes (issue 57, item 8, as it was), it does not."""
    if engine != "right":
        monkeypatch.setattr(ggml_blocks, "block_bytes", lambda nbytes: nbytes)
        monkeypatch.setattr(ggml_blocks, "_in_blocks", lambda nbytes: nbytes)
    kind = GGML_TYPES["Q4_0"]
    count = 3 * 1024**2 // 4  # values: a 1.5 MiB bf16 result, a 3 MiB float32 chunk
    raw = torch.randint(0, 255, (kind.nbytes(count),), dtype=torch.uint8)
    raw.view(-1, kind.size)[:, :2] = torch.tensor([0, 0x3C], dtype=torch.uint8)  # each block's scale 1.0 (fp16)
    device = SimulatedDevice(256 * 1024**2)
    on = device.place(raw)
    base = device.reserved()
    device.reset_peak()
    values = ggml_blocks.dequantize(on, kind, (count,), torch.bfloat16)
    held = device.peak_reserved() - base
    room = ggml_blocks.decode_bytes(kind, count, torch.bfloat16)
    assert (held <= room) == (engine == "right"), (held, room)
    del values, on
