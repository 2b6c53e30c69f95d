"""A split model in pipeline mode on two simulated GPUs and the CPU: each part's bytes on its device, the same
output as on one device bit for bit, the output back on the caller's device, and only activations moving."""

from __future__ import annotations

import gc

import pytest
import torch

from core.devices.sim.device import SimulatedDevice
from core.devices.sim.tensor import SimTensor
from core.devices.tensors import HOST
from core.placement.pipeline import attach_hops, place_split
from tests.core.split_net import FluxShaped, inputs, split_of


@pytest.mark.parametrize(
    "allocation", ["gpu:0=40%, gpu:1=60%", "gpu:0=30%, gpu:1=30%, cpu=*"], ids=["two GPUs", "a CPU remainder"]
)
def test_each_part_computes_where_it_lives_and_the_output_is_the_one_device_output_bit_for_bit(allocation):
    net = FluxShaped()
    img, t = inputs()
    with torch.no_grad():
        expected = net(img, t)
    gpus = SimulatedDevice(1 << 30, ordinal=0), SimulatedDevice(1 << 30, ordinal=1)
    targets = {"gpu:0": gpus[0], "gpu:1": gpus[1], "cpu": HOST}
    split = split_of(net, allocation)
    place_split(split, targets)
    for part, device in zip(split.parts, gpus, strict=False):  # each device holds its part's bytes, no more
        assert 0 < part.nbytes == device.allocated()
    hops = attach_hops(net, split, targets, home=gpus[0])
    with torch.no_grad():
        out = net(gpus[0].place(img), gpus[0].place(t))
    assert isinstance(out, SimTensor) and out.sim_device is gpus[0]  # back on the caller's device
    assert torch.equal(out.cpu(), expected)
    del out
    gc.collect()
    for part, device in zip(split.parts, gpus, strict=False):  # activations gone, weights where they were
        assert device.allocated() == part.nbytes
    if len(split.parts) == 3:
        assert split.parts[2].nbytes > 0 and all(p.device.type == "cpu" for p in net.final_layer.parameters())
    hops.remove()
    with torch.no_grad(), pytest.raises(RuntimeError, match="same device"):  # the hops did the moving
        net(gpus[0].place(img), gpus[0].place(t))
