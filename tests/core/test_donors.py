"""A split model in stream mode on two simulated GPUs and the CPU: the first GPU computes everything, the second
GPU and the CPU keep their parts and stream them to it, the next layers copied ahead; the output is the
one-device output bit for bit and every device's books hold its part."""

from __future__ import annotations

import gc

import torch

from core.devices.simtensor import SimTensor
from core.devices.simulated import SimulatedDevice
from core.devices.tensors import HOST, traffic
from core.placement.donors import place_streamed
from core.placement.plan import STREAM_COPIES
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
    streamed = place_streamed(split, targets, "gpu:0")
    own, lent, rest = (part.nbytes for part in split.parts)
    assert compute.allocated() == own and donor.allocated() == lent and rest > 0  # each part where it was put
    assert {layer.name for layer in streamed.layers} == {
        layer.name for part in split.parts[1:] for block in part.blocks for layer in block.layers
    }
    assert streamed.reserve_bytes == STREAM_COPIES * max(layer.nbytes for layer in streamed.layers)
    before, lent_before = traffic(compute).to_device, traffic(donor).to_peer
    for _ in range(2):  # the first pass learns the order, the second copies ahead
        with torch.no_grad():
            out = net(compute.place(img), compute.place(t))
        assert isinstance(out, SimTensor) and out.sim_device is compute  # it computed on the first GPU
        assert torch.equal(out.cpu(), expected)
        del out
    gc.collect()
    assert streamed.lookahead.stats.ahead > 0 and streamed.lookahead.in_flight_bytes == 0  # none left over
    assert compute.allocated() == own and donor.allocated() == lent  # the streamed copies are gone
    assert traffic(compute).to_device - before == 2 * (lent + rest)  # every streamed byte crossed, each pass
    assert traffic(donor).to_peer - lent_before == 2 * lent  # the second GPU's part left it for the first
    streamed.release()
    assert streamed.lookahead.stats.dropped == 0
