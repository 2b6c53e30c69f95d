"""Which layers go through the cast path (``comfy_cast_weights``) when a model's compute dtype changes with its
device (``core.weights.ops.set_cast_flags``): resident layers already in the compute dtype do not, streamed layers
and layers that need a dtype cast do, across load, offload and load on a simulated GPU."""

from __future__ import annotations

import torch

from core.devices.sim.device import SimulatedDevice
from core.placement.engine import partial_model_of
from core.weights import ops
from tests.core.order_net import Net
from tests.core.small_net import reserve_of, width

MiB = 1024**2


def _flags(net: Net) -> tuple[list[bool], list[bool]]:
    """The cast flags of the resident layers and of the streamed ones."""
    streamed = [hasattr(layer, "prev_comfy_cast_weights") for layer in net.layers]
    pairs = list(zip((layer.comfy_cast_weights for layer in net.layers), streamed, strict=True))
    return [f for f, s in pairs if not s], [f for f, s in pairs if s]


def test_resident_layers_in_the_compute_dtype_leave_the_cast_path_and_streamed_ones_keep_it():
    net = Net()
    for layer in net.layers:
        layer.comfy_cast_weights = True  # as a load to the CPU leaves them (float16 computed in float32 there)
    device = SimulatedDevice(64 * MiB)
    engine = partial_model_of(net)
    engine.load(device, 3 * engine.layers()[0].nbytes + reserve_of(engine.layers()[:1]))
    ops.set_cast_flags(net, torch.float32, None)  # on this device it computes in its stored dtype
    resident, streamed = _flags(net)
    assert resident and not any(resident) and streamed and all(streamed)
    x = torch.randn(2, width())
    with torch.no_grad():
        net(device.place(x))
    engine.unload_all()
    assert _flags(net) == ([False] * len(net.layers), [])  # offloaded: the flags it has now, not the CPU load's
    engine.load(device, engine.total_bytes())
    assert _flags(net) == ([False] * len(net.layers), [])
    engine.load(device, 3 * engine.layers()[0].nbytes + reserve_of(engine.layers()[:1]))
    resident, streamed = _flags(net)
    assert not any(resident) and streamed and all(streamed)


def test_a_compute_dtype_of_its_own_casts_every_layer_and_a_layer_in_another_dtype_keeps_its_flag():
    net = Net()
    net.layers[0].to(torch.float16)
    net.layers[0].comfy_cast_weights = True
    ops.set_cast_flags(net, torch.float32, None)
    assert net.layers[0].comfy_cast_weights and not any(layer.comfy_cast_weights for layer in net.layers[1:])
    ops.set_cast_flags(net, torch.float16, torch.float32)
    assert all(layer.comfy_cast_weights for layer in net.layers)
