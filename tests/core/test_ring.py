"""The ring: a model's whole streamed layers cross in groups, one copy per group into a fixed ring of device
buffers, in the order the model runs, and never at the cost of a wrong result.

These run the product's engine and cast layers on a simulated GPU whose streams check both orders a real GPU
needs: a read waits for the copy that filled its slot, and a copy waits for the reads of the slot's old contents
(either missing raises).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from core.devices.pinned import pinned_memory
from core.devices.sim.cost import LinkCost
from core.devices.tensors import traffic
from core.devices.transfer import GROUPED, to_target
from core.placement import prefetch, rings
from core.placement.engine import partial_model_of
from tests.core.order_net import LAYERS, on_host, streamed_net
from tests.core.platform_marks import STREAMS_AND_PINNING


@STREAMS_AND_PINNING
def test_whole_streamed_layers_go_through_the_ring_one_copy_per_group():
    net, device, x = streamed_net()
    ring = partial_model_of(net).ring
    grouped = [layer for layer in net.layers if GROUPED in layer.__dict__]
    assert len(grouped) == LAYERS - 2
    assert ring.slots == 2 and ring.host_bytes[0] > 0  # page-locked slabs on a backend that can pin
    first = net(device.place(x))
    # Each group once, and as the last computes the next step's first (a sampler's model runs step after step).
    assert ring.stats.copies == len(ring._groups) + 1 and ring.stats.ahead == ring.stats.copies - 1
    assert torch.equal(first.cpu(), on_host(net, x))


def test_a_sampled_model_copies_the_next_steps_first_group_ahead_and_settling_frees_the_ring():
    net, device, x = streamed_net()
    engine = partial_model_of(net)
    resident, groups = engine.resident_bytes(), len(engine.ring._groups)
    with torch.no_grad():  # as a sampler runs it: no graph keeping activations alive
        for _step in range(3):
            out = net(device.place(x)).cpu()
    gc.collect()
    assert device.allocated() == resident + engine.ring.ring_bytes
    # The last group's layers copy the next pass's first (a sampler's next step), from the first pass on: the
    # last pass's too, for a step that does not come, which settling drops.
    assert engine.ring.stats.copies == 3 * groups + 1 and engine.ring.stats.ahead == 3 * groups
    assert 0 < engine.ring.ring_bytes <= engine.plan.reserve_bytes
    assert rings.settle(net) > 0 and device.allocated() == resident  # nothing streamed stays after sampling
    assert torch.equal(out.cpu(), on_host(net, x))


def test_a_model_run_once_per_use_copies_nothing_for_a_next_run():
    net, device, x = streamed_net()
    ring = partial_model_of(net).ring
    ring.wraps = False  # a text encoder, a VAE
    resident = partial_model_of(net).resident_bytes()
    with torch.no_grad():
        for _use in range(3):
            out = net(device.place(x)).cpu()
            gc.collect()
            # Nothing settles such a model: its ring goes once its last group computed.
            assert ring.ring_bytes == 0 and device.allocated() == resident
    groups = len(ring._groups)
    assert ring.stats.copies == 3 * groups and ring.stats.ahead == 3 * (groups - 1)  # no pass starts ahead
    assert torch.equal(out.cpu(), on_host(net, x))


@pytest.mark.parametrize("stored", [torch.float32, torch.float16], ids=["computes as stored", "cast to fp32"])
def test_the_ring_and_a_cast_layer_stay_within_the_budget_plus_the_ring(stored):
    net, device, x = streamed_net(resident_layers=0, stored=stored)
    engine = partial_model_of(net)
    device.reset_peak()
    net(device.place(x))
    # The reserve holds the ring's two slots and the computing layer as stored; a layer cast to a wider dtype
    # may take its cast copy beyond it, within the budget plus the ring (the issue's bound).
    peak = device.peak_allocated() - engine.resident_bytes() - x.numel() * 4 * 2
    assert peak <= engine.plan.reserve_bytes + engine.ring.ring_bytes


def test_a_changed_order_is_learned_and_stays_right():
    net, device, x = streamed_net()
    ring = partial_model_of(net).ring
    net(device.place(x))
    net.reverse = True
    first = net(device.place(x))  # each move of the new order seen once
    net(device.place(x))  # seen twice: learned (a move seen once may be a call that skips blocks)
    net(device.place(x))  # the step from the last group to the first, seen twice: learned
    copies = ring.stats.copies
    second = net(device.place(x))
    assert ring.stats.copies - copies == len(ring._groups)  # every group copied once a pass, in the new order
    assert torch.equal(first.cpu(), on_host(net, x)) and torch.equal(second.cpu(), first.cpu())


def test_a_weight_replaced_by_another_tensor_is_packed_before_its_next_copy():
    net, device, x = streamed_net()
    net(device.place(x))
    layer = next(layer for layer in net.layers if GROUPED in layer.__dict__)
    layer.weight.data = torch.full_like(layer.weight, 0.01)  # replaced, not written in place
    rings.settle(net)
    assert torch.equal(net(device.place(x)).cpu(), on_host(net, x))


def test_a_weight_written_in_place_after_settling_is_copied_as_it_is_now():
    net, device, x = streamed_net()
    net(device.place(x))
    rings.settle(net)  # what the patcher does before ComfyUI's hooks rewrite weights in place
    for layer in net.layers:
        if GROUPED in layer.__dict__:
            layer.weight.data.mul_(0.5)
    assert torch.equal(net(device.place(x)).cpu(), on_host(net, x))


@pytest.mark.parametrize("between", ["rewrite", "settle"])
def test_weights_rewritten_in_place_between_two_calls_of_a_step_are_copied_as_they_are_now(between):
    """ComfyUI's hooks rewrite weights in place between two calls of one step: the patcher has the rings wait for
    the copies reading them and forget what their slots hold, keeping the slots for the next call (settling, which
    the end of sampling does, frees them and makes every layer's views again: twice a step; issue 57, item 2)."""
    net, device, x = streamed_net()
    ring = partial_model_of(net).ring
    net(device.place(x))
    held = ring.ring_bytes
    (rings.before_rewrite if between == "rewrite" else rings.settle)(net)
    for layer in net.layers:
        if GROUPED in layer.__dict__:
            layer.weight.data.mul_(0.5)
    out = net(device.place(x))
    assert torch.equal(out.cpu(), on_host(net, x))
    assert ring.ring_bytes == held > 0
    assert ring.stats.allocations == (1 if between == "rewrite" else 2)


@STREAMS_AND_PINNING
@pytest.mark.parametrize("pinned", [True, False], ids=["locked slabs", "staged slabs"])
def test_slots_kept_from_a_call_in_inference_mode_are_filled_in_a_call_outside_it(pinned, monkeypatch):
    """ComfyUI runs its nodes in inference mode, a training node or a script outside it; the slots (and staging
    buffers) a ring keeps between calls are plain tensors, filled in place in either."""
    if not pinned:
        monkeypatch.setattr(pinned_memory(), "max_bytes", 0)  # no slab locked: the groups cross through staging
    net, device, x = streamed_net()
    ring = partial_model_of(net).ring
    with torch.inference_mode():
        net(device.place(x))
    rings.before_rewrite(net)
    with torch.no_grad():
        out = net(device.place(x))
    assert torch.equal(out.cpu(), on_host(net, x)) and ring.stats.allocations == 1
    assert ring.host_bytes[0 if pinned else 1] > 0


def test_a_patch_function_never_changes_the_slot_or_the_stored_weight():
    net, device, x = streamed_net()
    layer = next(layer for layer in net.layers if GROUPED in layer.__dict__)
    stored = layer.weight.detach().clone()

    def doubled(weight: torch.Tensor) -> torch.Tensor:
        return weight.mul_(2)  # in place, on the private copy it is given

    layer.weight_function = [doubled]
    first = net(device.place(x))
    second = net(device.place(x))
    assert torch.equal(layer.weight.detach(), stored) and torch.equal(first.cpu(), second.cpu())


def test_prefetch_off_keeps_one_slot_copied_when_reached(monkeypatch):
    monkeypatch.setattr(prefetch, "_enabled", False)
    net, device, x = streamed_net()
    ring = partial_model_of(net).ring
    out = net(device.place(x))
    assert ring.slots == 1 and ring.stats.ahead == 0 and ring.stats.copies == len(ring._groups)
    assert torch.equal(out.cpu(), on_host(net, x))


def test_weights_made_in_inference_mode_stream_through_the_ring():
    with torch.inference_mode():
        net, device, x = streamed_net()
        out = net(device.place(x))
        again = net(device.place(x))
    assert partial_model_of(net).ring.stats.copies > 0
    assert torch.equal(out.cpu(), again.cpu()) and torch.equal(out.cpu(), on_host(net, x))


@STREAMS_AND_PINNING
def test_unloading_frees_the_ring_and_unlocks_the_slabs_which_stay_the_weights_home():
    """Offload To CPU: nothing on the device, nothing page-locked, no weight copied (copying at every offload and
    load is RAM a long run's allocator keeps); the next load locks the same slabs again."""
    net, device, x = streamed_net()
    engine = partial_model_of(net)
    budget = engine.plan.budget
    net(device.place(x))
    blocks = [group.block for group in engine.ring._slabs]
    assert pinned_memory().pinned_bytes >= sum(block.numel() for block in blocks) > 0
    engine.unload_all()
    assert device.allocated() == 0 and not any(GROUPED in layer.__dict__ for layer in net.layers)
    assert not any(pinned_memory().blocks.get(block.data_ptr()) for block in blocks)  # unlocked
    assert torch.equal(net(x), on_host(net, x))
    engine.load(device, budget)
    assert all(a is b for a, b in zip((group.block for group in engine.ring._slabs), blocks, strict=True))
    assert all(group.pinned for group in engine.ring._slabs)
    assert torch.equal(net(device.place(x)).cpu(), on_host(net, x))


def test_a_ring_without_room_for_both_slots_streams_with_one():
    net, device, x = streamed_net()
    engine = partial_model_of(net)
    x = device.place(x)
    # Another program took memory after the plan was made: room for one slot and the computing layer only.
    blocker = device.place(torch.empty(device.free() - 3 * engine.ring.group_bytes // 2, dtype=torch.uint8))
    out = net(x)
    assert engine.ring.slots == 1 and engine.ring.ring_bytes > 0
    assert torch.equal(out.cpu(), on_host(net, x.cpu()))
    del blocker


def test_grouped_copies_cost_the_host_less_than_one_copy_per_tensor():
    """On a link that charges what a real GPU's host pays per copy, the ring's copies (one per group) cost less
    host time than the per-tensor copies the layers make without it."""
    link = LinkCost.parse("53GB/s,10us,issue=100us")
    net, device, x = streamed_net(resident_layers=0, link=link)
    engine = partial_model_of(net)
    before = device.link.host_issue_seconds
    net(device.place(x))
    grouped = device.link.host_issue_seconds - before
    before = device.link.host_issue_seconds
    for layer in engine.streamed_layers():
        for tensor in (layer.module.weight, layer.module.bias):
            to_target(tensor, device)
    per_tensor = device.link.host_issue_seconds - before
    assert grouped < per_tensor


def test_a_weight_given_another_dtype_leaves_the_ring_and_still_computes_right():
    net, device, x = streamed_net()
    net(device.place(x))
    layer = next(layer for layer in net.layers if GROUPED in layer.__dict__)
    layer.weight.data = layer.weight.data.to(torch.float64).to(torch.float32).half()  # another tensor, fp16
    rings.settle(net)
    out = net(device.place(x))
    assert GROUPED not in layer.__dict__  # its layer copies its own tensors now
    assert torch.equal(out.cpu(), on_host(net, x))


def test_weights_converted_in_place_after_an_offload_let_their_old_slabs_go():
    """A model loaded with dtype ``auto`` and moved to a GPU is converted in place after its clones are unloaded
    (``nodes/bridge/auto_dtype.py``): the slabs its weights were packed into, kept for a next plan, would hold
    the old dtype's bytes in RAM beside the new ones until that plan. Once the engine is told its layers changed,
    nothing holds them; a slab whose weights did not change is kept."""
    net, device, x = streamed_net()
    engine = partial_model_of(net)
    net(device.place(x))
    engine.unload_all()
    blocks = {id(slab): weakref.ref(slab.block) for slab in engine.ring._kept.values()}
    assert len(blocks) > 1
    unchanged = next(iter(engine.ring._kept.values()))
    with torch.no_grad():
        for layer in net.layers:
            if engine.ring._kept.get(id(layer)) is not unchanged:
                layer.weight.data = layer.weight.data.half()
                layer.bias.data = layer.bias.data.half()
    engine.refresh()
    gc.collect()
    assert [id(slab) for slab in engine.ring._kept.values()] == [id(unchanged)] * len(unchanged.modules)
    assert sum(ref() is None for ref in blocks.values()) == len(blocks) - 1  # every other slab freed


def test_loading_again_with_the_same_groups_keeps_their_slabs():
    """ComfyUI loads a model again at every sampler (Move To GPU's load, then the sampler's): the weights are
    packed once, not at every load."""
    net, device, x = streamed_net()
    engine = partial_model_of(net)
    blocks = [group.block for group in engine.ring._slabs]
    engine.load(device, engine.plan.budget)
    assert all(a is b for a, b in zip((group.block for group in engine.ring._slabs), blocks, strict=True))
    assert torch.equal(net(device.place(x)).cpu(), on_host(net, x))


def test_the_ring_s_copies_are_booked_in_the_device_s_traffic():
    """The memory profile's "streamed" bytes and the benchmarks read the device's traffic books."""
    net, device, x = streamed_net()
    ring = partial_model_of(net).ring
    before, copied = traffic(device).to_device, ring.stats.nbytes
    net(device.place(x))
    assert traffic(device).to_device - before >= ring.stats.nbytes - copied > 0


def test_releasing_the_streaming_frees_the_ring_and_leaves_every_weight_where_it_is():
    """What Device Control does when it finds another loader took a model it placed (ComfyUI's own, through a
    clone): the ring's slots are not that loader's to keep, and nothing is moved back."""
    net, device, x = streamed_net()
    engine = partial_model_of(net)
    with torch.no_grad():
        net(device.place(x))
    resident = engine.resident_bytes()
    weights = [layer.weight.data_ptr() for layer in net.layers]
    engine.release_streaming()
    gc.collect()
    assert engine.ring.ring_bytes == 0 and device.allocated() == resident
    assert not any(GROUPED in layer.__dict__ for layer in net.layers)
    assert [layer.weight.data_ptr() for layer in net.layers] == weights


def test_two_orders_that_alternate_keep_the_full_pass_prefetched():
    """Skip-layer guidance calls the model twice a step, the second time leaving blocks out. A skip seen once is not
    learned as the new order: the full pass keeps every group copied ahead, and only the call that skips copies
    its group after the skip when reached (learning each call's order in turn made every call copy one so)."""
    net, device, x = streamed_net()
    ring = partial_model_of(net).ring
    skip = frozenset({3, 4})
    for _step in range(2):  # the order learned, and both calls seen
        for skipped in (frozenset(), skip):
            net.skipped = skipped
            net(device.place(x))
    reached = {}
    for _step in range(2):
        for skipped in (frozenset(), skip):
            net.skipped = skipped
            copies, ahead = ring.stats.copies, ring.stats.ahead
            out = net(device.place(x))
            reached[skipped] = reached.get(skipped, 0) + (ring.stats.copies - copies) - (ring.stats.ahead - ahead)
            assert torch.equal(out.cpu(), on_host(net, x))
    assert reached == {frozenset(): 0, skip: 2}, reached  # copied when reached: once a skipping call


def test_a_model_run_once_per_use_learns_a_changed_order_moving_back_too():
    """A model run once per use starts each use with no group before it, so a move back within a use is its order,
    learned as a move forward is: each group after the first copied ahead (a ring that took every move back for
    the start of a use copied each group only when reached)."""
    net, device, x = streamed_net()
    ring = partial_model_of(net).ring
    ring.wraps = False  # a text encoder, a VAE
    net(device.place(x))
    net.reverse = True
    for _use in range(3):  # each move seen twice, then the end of a use after its last group
        net(device.place(x))
    copies, ahead = ring.stats.copies, ring.stats.ahead
    out = net(device.place(x))
    assert ring.stats.copies - copies == len(ring._groups)  # every group once, none for a use that does not come
    assert ring.stats.ahead - ahead == len(ring._groups) - 1
    assert torch.equal(out.cpu(), on_host(net, x))
