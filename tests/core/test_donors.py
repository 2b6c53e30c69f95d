"""A split model in stream mode on two simulated GPUs and the CPU: the first GPU computes everything, the second
GPU and the CPU keep their parts and stream them to it through a ring each (the one streaming engine: their weights
packed in slabs on the donor, the next group copied ahead); the output is the one-device output bit for bit and
every device's books hold its part."""

from __future__ import annotations

import gc

import pytest
import torch

from core.devices.sim.device import SimulatedDevice
from core.devices.sim.tensor import SimTensor
from core.devices.tensors import HOST, traffic
from core.placement.donors import DONOR_COPIES, place_streamed, stream_room
from core.placement.plan import STREAM_COPIES
from core.placement.rings import settle
from core.placement.slabs import carried_bytes
from core.placement.split import ACTIVATIONS
from tests.core.split_net import FluxShaped, inputs, split_of


def _devices() -> tuple[SimulatedDevice, SimulatedDevice, dict]:
    gpus = SimulatedDevice(1 << 30, ordinal=0), SimulatedDevice(1 << 30, ordinal=1)
    return gpus[0], gpus[1], {"gpu:0": gpus[0], "gpu:1": gpus[1], "cpu": HOST}


def test_the_first_gpu_computes_and_the_donors_stream_their_parts_to_it_ahead_of_use():
    net = FluxShaped()
    img, t = inputs()
    with torch.no_grad():
        expected = net(img, t)
    compute, donor, targets = _devices()
    split = split_of(net, "gpu:0=30%, gpu:1=30%, cpu=*")
    streamed = place_streamed(split, targets, "gpu:0", root=net)
    own, lent, rest = (part.nbytes for part in split.parts)
    assert compute.allocated() == own and donor.allocated() == lent and rest > 0  # each part where it was put
    assert {layer.name for layer in streamed.layers} == {
        layer.name for part in split.parts[1:] for block in part.blocks for layer in block.layers
    }
    carried = max(carried_bytes(layer.module) for layer in streamed.layers)  # each tensor as its slab holds it
    assert streamed.reserve_bytes == DONOR_COPIES * carried == stream_room(split)
    before, lent_before = traffic(compute).to_device, traffic(donor).to_peer
    for _ in range(2):  # the first pass learns the order, the second copies ahead
        with torch.no_grad():
            out = net(compute.place(img), compute.place(t))
        assert isinstance(out, SimTensor) and out.sim_device is compute  # it computed on the first GPU
        assert torch.equal(out.cpu(), expected)
        del out
    gc.collect()
    rings = streamed.rings
    assert len(rings) == 2 and sum(ring.stats.ahead for ring in rings) > 0  # one per donor, copying ahead
    held = sum(ring.ring_bytes for ring in rings)  # the next pass's first groups, copied by this one's last
    assert 0 < held <= streamed.reserve_bytes
    copied = sum(ring.stats.nbytes for ring in rings)
    assert traffic(compute).to_device - before == copied >= 2 * (lent + rest)  # every streamed byte, each pass
    assert traffic(donor).to_peer - lent_before >= 2 * lent  # the second GPU's part left it
    assert settle(net) == held  # sampling ended (the patcher's cleanup): the rings are given back
    gc.collect()
    assert compute.allocated() == own and donor.allocated() == lent
    streamed.release()


@pytest.mark.parametrize(
    ("spare", "kept", "copies"),
    [(4, 0, 4), (0, 0, STREAM_COPIES), (DONOR_COPIES, 2, DONOR_COPIES - 2)],
    ids=["some room", "none", "the host keeps more free"],
)
def test_a_computing_gpu_short_of_room_copies_ahead_within_what_it_has_and_never_less_than_the_reserve(
    spare, kept, copies
):
    """The room for copies ahead is ``DONOR_COPIES`` of the largest streamed layer where the computing GPU has it
    free beside its part and what the host keeps free for its computation (the activations' room, or more: the
    node passes ComfyUI's minimum inference memory), what it has where less, and the budget's reserve at least."""
    net = FluxShaped()
    img, t = inputs()
    with torch.no_grad():
        expected = net(img, t)
    split = split_of(net, "gpu:0=30%, cpu=*")
    largest = stream_room(split) // DONOR_COPIES
    compute = SimulatedDevice(split.parts[0].nbytes + ACTIVATIONS + spare * largest, ordinal=0)
    streamed = place_streamed(
        split, {"gpu:0": compute, "cpu": HOST}, "gpu:0", keep_free=ACTIVATIONS + kept * largest, root=net
    )
    assert streamed.reserve_bytes == copies * largest
    for _ in range(3):
        with torch.no_grad():
            assert torch.equal(net(compute.place(img), compute.place(t)).cpu(), expected)
    assert sum(ring.stats.ahead for ring in streamed.rings) > 0
    streamed.release()
