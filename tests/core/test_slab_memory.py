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
from core.devices.sim.device import SimulatedDevice
from core.devices.slices import SLICES, RowSlices
from core.devices.transfer import GROUPED
from core.placement.engine import partial_model_of
from core.placement.prefetch import PREFETCH_SLOTS
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
    ring.attach(layers, device, PREFETCH_SLOTS * 4 * size)  # groups of four layers
    homes = [layer.weight.data_ptr() for layer in layers]
    ring.attach(layers, device, PREFETCH_SLOTS * 2 * size)  # groups of two: each within one of four
    assert [layer.weight.data_ptr() for layer in layers] == homes, "the streamed layers were packed again"


def test_a_group_in_a_larger_kept_slab_checks_only_its_own_tensors_before_each_copy():
    """Before a group crosses, the ring checks that its tensors still lie where they were packed (a weight replaced
    since is packed again first). A smaller budget streams from the slabs a larger one left, several groups to a
    slab: each copy checks its group's tensors, not the whole slab's once per group (issue 57, item 5)."""
    torch.manual_seed(0)
    layers = [ops.Linear(64, 64) for _ in range(8)]
    device, ring, size = SimulatedDevice(64 * MiB), Ring(), layer_bytes(layers[0])
    ring.attach(layers, device, PREFETCH_SLOTS * 4 * size)  # groups of four layers
    ring.attach(layers, device, PREFETCH_SLOTS * 2 * size)  # groups of two: two in each slab
    assert len(ring._groups) == 2 * len(ring._slabs)
    x = torch.randn(2, 64)
    for layer in layers:
        layer.comfy_cast_weights = True  # as the engine marks the layers it streams
    expected = x
    for layer in layers:
        expected = torch.nn.functional.linear(expected, layer.weight, layer.bias)
    out = device.place(x)
    with torch.no_grad():
        for layer in layers:
            out = layer(out)
    ring.settle()
    assert ring.stats.copies >= len(ring._groups)
    assert ring.stats.checked == 2 * 2 * ring.stats.copies  # two layers a group, a weight and a bias each
    assert torch.allclose(out.cpu(), expected, atol=1e-5)


def test_a_layer_in_slices_given_another_dtype_leaves_the_ring_at_its_first_slice_and_computes_right():
    """Each slice of a layer streamed in row slices is a group of its own; the first one copied finds the weight
    replaced by one of another dtype and the layer leaves the ring: the next slices' groups, copied ahead, find
    it gone, and the layer computes from its own copies."""
    torch.manual_seed(0)
    layer = ops.Linear(96, 256)
    layer.comfy_cast_weights = True
    layer.__dict__[SLICES] = RowSlices((0, 128, 192, 256))
    device, ring = SimulatedDevice(64 * MiB), Ring()
    ring.attach([layer], device, PREFETCH_SLOTS * layer_bytes(layer))
    assert len(ring._groups) == 3
    layer.weight.data = layer.weight.data.half()  # another tensor, fp16
    x = torch.randn(5, 96)
    with torch.no_grad():
        out = layer(device.place(x)).cpu()
    ring.settle()
    assert GROUPED not in layer.__dict__
    assert torch.equal(out, torch.nn.functional.linear(x, layer.weight.float(), layer.bias))
