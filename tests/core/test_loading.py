"""The partial loading engine on a small model and a simulated GPU: plans, books, eviction, OOM, interruption."""

from __future__ import annotations

import gc

import psutil
import pytest
import torch

from core.devices.simtensor import SimTensor
from core.devices.simulated import SimulatedDevice
from core.devices.tensors import move_own, own_tensors
from core.errors import DeviceControlError
from core.placement.budget import Budget
from core.placement.engine import partial_model_of
from core.placement.eviction import make_room
from core.placement.plan import STREAM_COPIES, Policy, layers_of, plan_layers
from core.placement.streaming import LayerHooks
from core.weights import ops

MiB = 1024**2


class Scale(torch.nn.Module):
    """A layer without the cast protocol: it can never stream."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.register_buffer("offset", torch.full((width,), 0.25))
        self.register_buffer("scratch", torch.zeros(width), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.offset


class Net(torch.nn.Module):
    """Two big layers among small ones, a norm and a layer that cannot stream, in a known order."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = ops.Linear(64, 64)
        self.norm = ops.LayerNorm(64)
        self.middle = ops.Linear(64, 512)
        self.fixed = Scale(512)
        self.back = ops.Linear(512, 64)
        self.tail = torch.nn.Sequential(*(ops.Linear(64, 64) for _ in range(6)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.first(x))
        x = self.fixed(torch.relu(self.middle(x)))
        return self.tail(torch.relu(self.back(x)))


def partial_budget(net: Net) -> int:
    """Room for the big layers and the fixed one; the small ones stream."""
    size = sizes(net)
    return size["fixed"] + size["middle"] + size["back"] + size["norm"] + STREAM_COPIES * size["first"]


def sizes(net: torch.nn.Module) -> dict[str, int]:
    return {layer.name: layer.nbytes for layer in layers_of(net)}


@pytest.fixture
def net() -> Net:
    return Net()


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(4, 64, generator=torch.Generator().manual_seed(1))


def run(net: Net, x: torch.Tensor, device: SimulatedDevice) -> torch.Tensor:
    out = net(device.place(x))
    assert isinstance(out, SimTensor) and out.sim_device is device  # it computed on the device
    return device.release(out).clone()


def test_layers_and_sizes_follow_the_module_tree(net):
    layers = layers_of(net)
    assert [la.name for la in layers][:6] == ["first", "norm", "middle", "fixed", "back", "tail.0"]
    assert sizes(net)["middle"] == (64 * 512 + 512) * 4
    assert sizes(net)["fixed"] == 3 * 512 * 4  # buffers count, saved or not: they take device memory
    assert [la.streamable for la in layers][:5] == [True, True, True, False, True]


def test_tied_weights_count_once():
    net = torch.nn.Sequential(ops.Embedding(10, 8), ops.Linear(8, 10, bias=False))
    net[1].weight = net[0].weight
    assert sum(la.nbytes for la in layers_of(net)) == 10 * 8 * 4


def test_everything_resident_when_it_fits(net):
    layers = layers_of(net)
    plan = plan_layers(layers, 10 * MiB)
    assert plan.resident == {la.name for la in layers} and plan.streamed_bytes == 0 and plan.reserve_bytes == 0


def shelf(*dims: int) -> torch.nn.ModuleList:
    """Independent square layers of these widths, in this order."""
    return torch.nn.ModuleList([ops.Linear(d, d) for d in dims])


@pytest.mark.parametrize("policy", list(Policy))
def test_plans_stay_within_the_budget_with_room_to_stream(policy):
    layers = layers_of(shelf(32, 48, 128, 32, 64, 32))
    total = sum(la.nbytes for la in layers)
    for budget in range(0, total + 1, total // 50):
        plan = plan_layers(layers, budget, policy)
        streamed = [la.nbytes for la in layers if la.name not in plan.resident]
        assert plan.reserve_bytes == STREAM_COPIES * max(streamed, default=0)
        assert plan.resident_bytes + plan.reserve_bytes <= budget or not plan.resident


def test_execution_order_keeps_a_run_from_the_start():
    layers = layers_of(shelf(32, 32, 32, 32, 32, 32))
    small = layers[0].nbytes
    plan = plan_layers(layers, 2 * small + STREAM_COPIES * small, Policy.EXECUTION_ORDER)
    assert plan.resident == {"0", "1"} and plan.streamed_layers == 4


def test_largest_first_keeps_the_big_layer_that_execution_order_must_stream():
    layers = layers_of(shelf(32, 32, 128, 32, 32, 32))
    small, big = layers[0].nbytes, layers[2].nbytes
    budget = big + STREAM_COPIES * small + small // 2
    assert plan_layers(layers, budget, Policy.LARGEST_FIRST).resident == {"2"}
    assert plan_layers(layers, budget, Policy.EXECUTION_ORDER).resident == frozenset()


def test_an_unload_plan_only_keeps_layers_that_were_resident():
    layers = layers_of(shelf(32, 32, 32, 32))
    plan = plan_layers(layers, 10 * MiB, allowed=["0", "1"])
    assert plan.resident == {"0", "1"}


def test_a_budget_below_the_fixed_layers_keeps_them_and_says_so(net):
    plan = plan_layers(layers_of(net), 0)
    assert plan.resident == {"fixed"} and plan.over_budget


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
    assert device.allocated() == report.resident_bytes  # the cast copies were released after use
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


class Loaded:
    """A model loaded on a device, offered to ``make_room`` the way the host's list offers its entries."""

    def __init__(self, name: str, root: torch.nn.Module, keep_resident: bool = False) -> None:
        self.name, self.engine, self.keep_resident = name, partial_model_of(root), keep_resident
        self.device = "gpu:0"

    def resident_on(self, target):
        return self.engine.resident_bytes(target) if self.engine.target is target else 0

    def give_back(self, target, nbytes):
        return self.engine.unload_all() if nbytes is None else self.engine.unload(nbytes)


def test_make_room_evicts_least_recently_used_first_partially_and_spares_kept_models():
    nets = [Net() for _ in range(3)]
    total = sum(la.nbytes for la in layers_of(nets[0]))
    device = SimulatedDevice(2 * total + total // 2)
    kept, older, newest = Loaded("kept", nets[0], True), Loaded("older", nets[1]), Loaded("newest", nets[2])
    for model in (kept, older):
        model.engine.load(device, total)
    eviction = make_room([older, kept], device, total)  # most recently used first, as ComfyUI lists them
    assert [given.name for given in eviction.evicted] == ["older"] and eviction.short == 0
    assert 0 < older.resident_on(device) < total  # it gave back only what was missing, streaming the rest
    newest.engine.load(device, total)
    assert kept.resident_on(device) == total == newest.resident_on(device)
    assert device.allocated() == sum(m.resident_on(device) for m in (kept, older, newest))


def test_make_room_gives_kept_models_only_when_asked():
    nets = [Net(), Net()]
    total = sum(la.nbytes for la in layers_of(nets[0]))
    device = SimulatedDevice(2 * total)
    models = [Loaded("b", nets[1], True), Loaded("a", nets[0], True)]
    for model in models:
        model.engine.load(device, total)
    assert make_room(models, device, total).short == total
    eviction = make_room(models, device, total, include_kept=True)
    assert eviction.short == 0 and [given.name for given in eviction.evicted] == ["a"]  # least recently used


@pytest.mark.parametrize(
    ("text", "capacity", "expected"),
    [("all", 8 * MiB, 8 * MiB), ("", 8, 8), ("2MiB", 8 * MiB, 2 * MiB), ("50%", 8 * MiB, 4 * MiB), ("0", 8, 0)],
)
def test_budgets_resolve_against_the_device(text, capacity, expected):
    assert Budget.parse(text).resolve(capacity) == expected


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("-1GB", "negative"),
        ("nan", "not a finite"),
        ("nan%", "between 0% and 100%"),
        ("150%", "between 0% and 100%"),
        ("lots", "Accepted forms"),
    ],
)
def test_bad_budgets_are_refused_with_the_accepted_forms(text, problem):
    with pytest.raises(ValueError, match=problem):
        Budget.parse(text)


def test_a_budget_larger_than_the_device_names_the_largest_one():
    with pytest.raises(ValueError, match=r"larger than gpu:0, which holds 8.00 MiB; use at most that"):
        Budget.parse("1GB").resolve(8 * MiB, device="gpu:0")


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
