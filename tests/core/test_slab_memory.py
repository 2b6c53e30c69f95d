"""Host slabs across plans: a new budget must not leave host memory behind (issue 50, hazard 10).

Measured on SD1.5 (fp32, a simulated GPU) through Move To GPU's own path: going from a 1 GB budget to 600 MB, the
process grew by about 770 MiB. About 715 MiB of it is memory the allocator kept after every streamed layer was
packed again into new slabs (the groups are sized from the plan's streaming reserve, 48 groups of 28 MiB at 1 GB and
81 of 14 MiB at 600 MB: all 935 MiB of new slabs allocated while the 1153 MiB of old ones were still alive;
``malloc_trim`` gives it back), the rest old slabs kept alive by the weights left in them. A plan that streams
nothing through the ring also kept every old slab, page-locked. These tests say what the ring must do instead.
"""

from __future__ import annotations

import torch

from core.devices.pinned import pinned_memory
from core.devices.simulated import SimulatedDevice
from core.placement.engine import partial_model_of
from core.placement.ring import Ring
from core.placement.slabs import layer_bytes
from core.weights import ops
from tests.core.order_net import MiB, streamed_net
from tests.core.platform_marks import STREAMS_AND_PINNING


@STREAMS_AND_PINNING
def test_a_plan_with_nothing_to_stream_keeps_no_slab_locked():
    net, device, _x = streamed_net(resident_layers=2)
    engine = partial_model_of(net)
    slabs = engine.ring.host_bytes[0]
    assert slabs > 0  # the streamed layers' slabs, page-locked
    locked = pinned_memory().pinned_bytes
    engine.load(device, 2 * engine.total_bytes())  # everything resident: the ring carries nothing
    assert engine.resident_bytes() == engine.total_bytes()
    assert pinned_memory().pinned_bytes == locked - slabs


def test_a_smaller_reserve_streams_from_the_slabs_it_has():
    torch.manual_seed(0)
    layers = [ops.Linear(64, 64) for _ in range(8)]
    device, ring, size = SimulatedDevice(64 * MiB), Ring(), layer_bytes(layers[0])
    ring.attach(layers, device, 3 * 4 * size)  # groups of four layers
    homes = [layer.weight.data_ptr() for layer in layers]
    ring.attach(layers, device, 3 * 2 * size)  # groups of two: each within one of four
    assert [layer.weight.data_ptr() for layer in layers] == homes, "the streamed layers were packed again"
