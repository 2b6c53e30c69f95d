"""The partial loading engine on a small model and a simulated GPU: books, moves, hooks, out of memory,
interruption."""

from __future__ import annotations

import gc

import psutil
import pytest
import torch

from core.devices.memory import is_out_of_memory
from core.devices.sim.device import SimulatedDevice
from core.devices.sim.tensor import SimTensor
from core.devices.tensors import move_own, own_tensors
from core.errors import DeviceControlError, first_line
from core.placement.engine import partial_model_of
from core.placement.plan import layers_of
from core.placement.rings import settle
from core.placement.streaming import LayerHooks
from core.weights import ops
from tests.core.faults import NOT_OUT_OF_MEMORY, OUT_OF_MEMORY, fail_moves
from tests.core.small_net import Scale, partial_budget, run, sizes

MiB = 1024**2


def test_load_books_forward_and_unload(net, x):
    reference = net(x)
    device = SimulatedDevice(64 * MiB)
    engine = partial_model_of(net)
    report = engine.load(device, 10 * MiB)
    assert report.resident_bytes == engine.total_bytes() == device.allocated()
    assert all(isinstance(p, SimTensor) for p in net.parameters())
    assert torch.equal(run(net, x, device), reference)
    freed = engine.unload_all()
    gc.collect()
    assert freed == report.resident_bytes and device.allocated() == 0
    assert not any(isinstance(p, SimTensor) for p in net.parameters())
    assert torch.equal(net(x), reference)  # back on the host, as it was


def test_partial_load_streams_the_rest_and_computes_the_same(net, x):
    reference = net(x)
    device = SimulatedDevice(64 * MiB)
    engine = partial_model_of(net)
    report = engine.load(device, partial_budget(net))
    assert report.streamed_bytes > 0 and report.resident_bytes == device.allocated()
    assert net.first.comfy_cast_weights and not net.middle.comfy_cast_weights
    assert not isinstance(net.first.weight, SimTensor) and isinstance(net.middle.weight, SimTensor)
    out = run(net, x, device)
    assert torch.equal(out, reference)
    # The ring's slots stay until sampling ends (they are inside the plan's streaming reserve); the cast copies
    # made from them were released after use.
    assert device.allocated() == report.resident_bytes + engine.ring.ring_bytes
    assert 0 < engine.ring.ring_bytes <= report.plan.reserve_bytes
    settle(net)
    assert device.allocated() == report.resident_bytes
    assert "streamed from cpu (7 layers)" in report.summary()


def test_a_forgotten_move_fails_like_a_device_mismatch(net, x):
    device = SimulatedDevice(64 * MiB)
    engine = partial_model_of(net)
    engine.load(device, 10 * MiB)
    net.middle.weight.data = device.release(net.middle.weight)  # back in RAM, but no cast path set
    with pytest.raises(RuntimeError, match="same device"):
        net(device.place(x))


def test_unload_frees_what_is_asked_and_never_moves_layers_in(net, x):
    reference = net(x)
    device = SimulatedDevice(64 * MiB)
    engine = partial_model_of(net)
    engine.load(device, 10 * MiB)
    before = {la.name for la in engine.layers() if la.is_resident(device)}
    freed = engine.unload(sizes(net)["norm"] + 1)
    gc.collect()
    after = {la.name for la in engine.layers() if la.is_resident(device)}
    assert freed >= sizes(net)["norm"] + 1 and after < before
    assert device.allocated() == engine.resident_bytes()
    assert torch.equal(run(net, x, device), reference)


def test_moving_to_another_device_leaves_the_first(net, x):
    reference = net(x)
    first, second = SimulatedDevice(64 * MiB), SimulatedDevice(64 * MiB, ordinal=1)
    engine = partial_model_of(net)
    engine.load(first, 10 * MiB)
    engine.load(second, 10 * MiB)
    gc.collect()
    assert first.allocated() == 0 and second.allocated() == engine.total_bytes()
    assert torch.equal(run(net, x, second), reference)


def test_loading_to_the_host_keeps_everything_plain(net, x):
    reference = net(x)
    engine = partial_model_of(net)
    engine.load(SimulatedDevice(64 * MiB), 0)
    engine.load(torch.device("cpu"), 0)  # on the host there is nothing to stream from
    assert not any(getattr(m, "comfy_cast_weights", False) for m in net.modules())
    assert torch.equal(net(x), reference)


def test_hooks_see_every_change(net):
    calls: list[tuple[str, str]] = []

    class Recorder(LayerHooks):
        def before_resident(self, layer, target):
            calls.append(("resident", layer.name))

        def before_leaving(self, layer):
            calls.append(("leaving", layer.name))

        def on_streamed(self, layer):
            calls.append(("streamed", layer.name))

    device = SimulatedDevice(64 * MiB)
    engine = partial_model_of(net)
    engine.load(device, partial_budget(net), hooks=Recorder())
    assert ("resident", "middle") in calls and ("streamed", "first") in calls
    calls.clear()
    engine.unload_all(hooks=Recorder())
    assert set(calls) == {("leaving", name) for name in ("norm", "middle", "fixed", "back")}


def test_the_engine_knows_whether_the_tree_is_as_it_left_it(net, x):
    """Another loader moving the weights (ComfyUI's own, through a clone sharing them) is seen from the tensors."""
    reference = net(x)
    device, other = SimulatedDevice(64 * MiB), SimulatedDevice(64 * MiB, ordinal=1)
    engine = partial_model_of(net)
    assert not engine.holds(device)  # never loaded
    engine.load(device, partial_budget(net))
    assert engine.holds(device) and not engine.holds(other) and not engine.holds(torch.device("cpu"))
    net.middle.to("cpu")  # a resident layer taken back to the host behind the engine's back
    assert not engine.holds(device)
    engine.load(device, partial_budget(net))
    assert engine.holds(device)
    net.first.comfy_cast_weights = net.first.prev_comfy_cast_weights  # a streamed layer's cast mark wiped
    del net.first.prev_comfy_cast_weights
    assert not engine.holds(device)
    engine.load(device, partial_budget(net))
    assert engine.holds(device) and torch.equal(run(net, x, device), reference)
    engine.unload_all()
    assert not engine.holds(device) and engine.plan is None


def test_layers_another_loader_left_on_another_device_leave_it(net, x):
    """Weights put on a device by someone else (the engine never loaded them) leave it when the engine places the
    model elsewhere, instead of staying there while marked as streamed."""
    reference = net(x)
    foreign, device = SimulatedDevice(64 * MiB, ordinal=1), SimulatedDevice(64 * MiB)
    for layer in layers_of(net):
        for name, _tensor, _is_param in list(own_tensors(layer.module)):
            move_own(layer.module, name, foreign)
    assert foreign.allocated() == sum(sizes(net).values())
    engine = partial_model_of(net)
    engine.load(device, partial_budget(net))
    gc.collect()
    assert foreign.allocated() == 0 and device.allocated() == engine.resident_bytes(device)
    assert engine.holds(device) and torch.equal(run(net, x, device), reference)


def test_leaving_the_host_for_a_device_restores_what_was_patched_there(net):
    """A model loaded (and patched) on the host, then moved to a device: every layer resident on the host leaves it
    first, so its owner restores the patched weight before the layer is patched again or streams (a weight
    patched on the host and then patched again on the fly would carry its LoRA twice)."""
    left: list[str] = []

    class Recorder(LayerHooks):
        def before_leaving(self, layer):
            left.append(layer.name)

    engine = partial_model_of(net)
    engine.load(torch.device("cpu"), 0, hooks=Recorder())
    engine.load(SimulatedDevice(64 * MiB), partial_budget(net), hooks=Recorder())
    assert sorted(left) == sorted(sizes(net))


def test_a_hundred_cycles_leave_no_drift(net):
    device = SimulatedDevice(64 * MiB)
    engine = partial_model_of(net)
    process = psutil.Process()
    engine.load(device, 10 * MiB)
    engine.unload_all()
    gc.collect()
    rss = process.memory_info().rss
    for cycle in range(100):
        engine.load(device, 10 * MiB if cycle % 2 else partial_budget(net))
        assert device.allocated() == engine.resident_bytes()
        engine.unload_all()
    gc.collect()
    assert device.allocated() == 0
    assert process.memory_info().rss < rss * 1.01 + 4 * MiB


def test_out_of_memory_lowers_the_budget_and_the_model_still_works(net, x):
    reference = net(x)
    total = sum(sizes(net).values())
    # Another program holds memory the device does not report: the plan thinks everything fits.
    device = SimulatedDevice(total + MiB, used_by_others=total // 2 + MiB, faults={"unreported_others"})
    engine = partial_model_of(net)
    report = engine.load(device, total)
    assert report.oom is not None and "budget lowered" in report.oom
    assert 0 < report.resident_bytes < total
    assert device.allocated() == report.resident_bytes
    assert torch.equal(run(net, x, device), reference)
    again = engine.load(device, total)  # the lowered budget is remembered: no second failure
    assert again.oom is None and again.resident_bytes == report.resident_bytes
    assert engine.limits


def test_no_room_even_for_the_fixed_layers_is_a_clear_error_and_loses_nothing(net, x):
    reference = net(x)
    device = SimulatedDevice(MiB, used_by_others=MiB - 1024, faults={"unreported_others"})
    engine = partial_model_of(net)
    with pytest.raises(DeviceControlError, match=r"cannot stream.*stays in RAM"):
        engine.load(device, MiB)
    gc.collect()
    assert device.allocated() == 0
    assert torch.equal(net(x), reference)


def test_an_interrupted_load_leaves_a_consistent_usable_model(net, x):
    reference = net(x)
    device = SimulatedDevice(64 * MiB)
    engine = partial_model_of(net)

    def stop_after_two(done: int, total: int) -> None:
        if done == 2:
            raise KeyboardInterrupt("cancelled")

    with pytest.raises(KeyboardInterrupt):
        engine.load(device, 10 * MiB, progress=stop_after_two)
    resident = [la.name for la in engine.layers() if la.is_resident(device)]
    assert resident == ["first", "fixed"]  # the layer that cannot stream moved first
    assert all(la.module.comfy_cast_weights for la in engine.streamed_layers())
    assert device.allocated() == engine.resident_bytes()
    assert torch.equal(run(net, x, device), reference)


@pytest.mark.gpu(proves="a load takes real VRAM and an offload gives all of it back")
def test_cuda_load_and_offload_move_real_memory(net, x):
    """On a GPU this proves: free VRAM drops by what the engine says is resident after a load, returns to the
    baseline after unload_all, and a partially loaded model computes the same as on the CPU."""
    reference = net(x)
    device = torch.device("cuda", 0)
    baseline = torch.cuda.memory_allocated(device)
    engine = partial_model_of(net)
    report = engine.load(device, partial_budget(net))
    assert torch.cuda.memory_allocated(device) - baseline >= report.resident_bytes
    torch.testing.assert_close(net(x.to(device)).cpu(), reference)
    engine.unload_all()
    assert torch.cuda.memory_allocated(device) == baseline


def _tensor_count(net: torch.nn.Module) -> int:
    return sum(1 for t in (*net.parameters(), *net.buffers()) if t is not None)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_out_of_memory_at_any_layer_of_a_move_is_survived_with_true_books(net, x, where):
    reference = net(x)
    total = sum(sizes(net).values())
    count = _tensor_count(net)
    device = SimulatedDevice(4 * total)
    device.fail_allocation({"first": 0, "middle": count // 2, "last": count - 1}[where])
    engine = partial_model_of(net)
    report = engine.load(device, 2 * total)
    assert report.oom is not None and "Tried to allocate" in report.oom  # the device's own words, kept
    assert "budget lowered" in report.oom
    assert device.allocated() == engine.resident_bytes() == report.resident_bytes < total
    assert torch.equal(run(net, x, device), reference)
    engine.unload_all()
    gc.collect()
    assert device.allocated() == 0
    assert torch.equal(net(x), reference)


@pytest.mark.parametrize("kind", OUT_OF_MEMORY)
def test_out_of_memory_of_every_kind_is_recognised(kind):
    assert is_out_of_memory(OUT_OF_MEMORY[kind]())


@pytest.mark.parametrize("kind", NOT_OUT_OF_MEMORY)
def test_other_errors_are_not_taken_for_out_of_memory(kind):
    assert not is_out_of_memory(NOT_OUT_OF_MEMORY[kind]())


@pytest.mark.parametrize("kind", OUT_OF_MEMORY)
def test_out_of_memory_of_every_kind_in_a_move_is_survived_with_true_books(net, x, monkeypatch, kind):
    """What a real H100 raised in a load under memory pressure was a ``torch.AcceleratorError`` from a CUDA
    call outside the caching allocator; the guard survives it as it survives the allocator's own error."""
    reference = net(x)
    total = sum(sizes(net).values())
    device = SimulatedDevice(4 * total)
    fail_moves(monkeypatch, device, OUT_OF_MEMORY[kind], _tensor_count(net) // 2)
    engine = partial_model_of(net)
    report = engine.load(device, 2 * total)
    assert report.oom is not None and "budget lowered" in report.oom
    assert first_line(OUT_OF_MEMORY[kind]()) in report.oom  # the device's own words, kept
    assert device.allocated() == engine.resident_bytes() == report.resident_bytes < total
    assert torch.equal(run(net, x, device), reference)
    engine.unload_all()
    gc.collect()
    assert device.allocated() == 0


@pytest.mark.parametrize("kind", ["cuda runtime (AcceleratorError)", "hip runtime"])
def test_out_of_memory_of_a_runtime_on_every_try_is_the_clear_error_and_loses_nothing(net, x, monkeypatch, kind):
    reference = net(x)
    total = sum(sizes(net).values())
    device = SimulatedDevice(4 * total)
    fail_moves(monkeypatch, device, OUT_OF_MEMORY[kind], 0, times=1_000)
    engine = partial_model_of(net)
    with pytest.raises(DeviceControlError, match=r"cannot stream.*stays in RAM"):
        engine.load(device, 2 * total)
    gc.collect()
    assert device.allocated() == 0
    assert torch.equal(net(x), reference)


def test_the_guard_gives_the_cache_back_once_the_lowered_plan_is_in_place(net, monkeypatch):
    """The layers the lowered plan sends back to the host leave their memory in torch's cache, which a CUDA
    stream or a library's handle made next cannot use (on an H100 the first side stream then failed): the
    cache is emptied after they left, not only before."""
    from core.placement import engine as engine_module

    total = sum(sizes(net).values())
    device = SimulatedDevice(4 * total)
    device.fail_allocation(_tensor_count(net) // 2)
    emptied: list[int] = []
    monkeypatch.setattr(engine_module, "empty_cache", lambda target: emptied.append(device.allocated()))
    report = partial_model_of(net).load(device, 2 * total)
    assert report.oom is not None and emptied
    assert emptied[-1] == report.resident_bytes  # the last emptying saw the lowered plan in place


@pytest.mark.parametrize("kind", NOT_OUT_OF_MEMORY)
def test_an_error_that_is_not_out_of_memory_goes_on_and_lowers_no_budget(net, monkeypatch, kind):
    total = sum(sizes(net).values())
    device = SimulatedDevice(4 * total)
    error = NOT_OUT_OF_MEMORY[kind]()
    fail_moves(monkeypatch, device, NOT_OUT_OF_MEMORY[kind], _tensor_count(net) // 2)
    engine = partial_model_of(net)
    with pytest.raises(type(error)) as raised:
        engine.load(device, 2 * total)
    assert type(raised.value) is type(error) and str(raised.value) == str(error)  # unchanged, not wrapped
    assert not engine.limits


class _Wide(torch.nn.Module):
    """Four 4 MiB cast linears and a 768 KiB layer that cannot stream: no layer fits a small budget whole."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(ops.Linear(1024, 1024, bias=False) for _ in range(4))
        self.fixed = Scale(64 * 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_budget_smaller_than_every_layer_is_used_and_the_summary_says_no_shortfall():
    """What Move To GPU printed for the small Flux of the issue ("below the 42 KiB this model cannot stream",
    with everything streamed): a budget that holds what cannot stream and the streaming reserve is used, and
    the summary says nothing is missing."""
    net, device = _Wide(), SimulatedDevice(64 * MiB)
    x = torch.randn(3, 1024)
    reference = net(x)
    report = partial_model_of(net).load(device, 9 * MiB)
    assert report.resident_bytes >= 4 * MiB and report.plan.slices  # a whole layer resident, the others in slices
    assert report.resident_bytes + report.plan.reserve_bytes <= 9 * MiB
    assert "in row slices" in report.summary() and "budget" not in report.summary()
    assert torch.equal(run(net, x, device), reference)


def test_a_budget_that_cannot_hold_what_cannot_stream_and_the_reserve_names_what_it_is_missing():
    net, device = _Wide(), SimulatedDevice(64 * MiB)
    report = partial_model_of(net).load(device, 2 * MiB)
    plan = report.plan
    assert plan.over_budget and plan.resident_bytes == plan.fixed_bytes == 768 * 1024
    assert plan.reserve_bytes == 3 * MiB  # three pieces of the smallest unit (1 MiB)
    assert report.summary().endswith(
        "; the budget 2.00 MiB cannot hold the 768.00 KiB of this model that cannot stream plus the 3.00 MiB it "
        "needs to stream the rest: it needs at least 3.75 MiB, so it runs 1.75 MiB over its budget"
    )


def test_a_tight_budget_streams_in_the_smallest_slices_before_it_says_what_is_missing():
    """Between what cannot stream plus the least reserve (1 MiB pieces) and that plus the budget's own unit, the
    plan slices finer rather than run over: the figure a short budget is told to reach is enough."""
    net, device = _Wide(), SimulatedDevice(128 * MiB)
    net.fixed = Scale(int(41.5 * MiB / 12))  # 41.5 MiB that cannot stream
    engine = partial_model_of(net)
    report = engine.load(device, 45 * MiB)  # its own unit (1.25 MiB) would need 41.5 + 3.75 MiB
    assert not report.plan.over_budget and report.plan.reserve_bytes == 3 * MiB
    engine.unload_all()
    short = engine.load(device, 44 * MiB)
    assert short.plan.over_budget and "it needs at least 44.50 MiB" in short.summary()
