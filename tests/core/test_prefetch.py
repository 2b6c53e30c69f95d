"""Prefetch: the next streamed layers' copies are queued while the current one computes, in the order the model
really runs, within the room the plan keeps, and never at the cost of a wrong result.

These run the product's engine and cast layers on a simulated GPU, whose streams check that every copy is
waited for before it is used (a missing wait raises), so a prefetched weight used too early fails here.
"""

from __future__ import annotations

import pytest
import torch

from core.devices.backends import backend_of
from core.devices.simlink import MissingWaitError
from core.devices.simulated import SimulatedDevice
from core.devices.transfer import LOOKAHEAD
from core.errors import InvalidSizeError
from core.placement import prefetch
from core.placement.engine import partial_model_of
from core.placement.plan import STREAM_COPIES
from core.weights import ops

MiB = 1024**2
LAYERS = 8


class Net(torch.nn.Module):
    """Eight cast linears, run forwards or (``reverse``) backwards: a model whose order can change."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(ops.Linear(64, 64) for _ in range(LAYERS))
        self.reverse = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in reversed(self.layers) if self.reverse else self.layers:
            x = layer(x)
        return x


def _streamed_net(
    resident_layers: int = 2, stored: torch.dtype = torch.float32
) -> tuple[Net, SimulatedDevice, torch.Tensor]:
    """The net (its weights in ``stored``) with its ``resident_layers`` largest-first layers on a simulated GPU,
    the rest streaming; the input is fp32."""
    device = SimulatedDevice(64 * MiB)
    net = Net().to(stored)
    engine = partial_model_of(net)
    engine.load(device, (resident_layers + STREAM_COPIES) * engine.layers()[0].nbytes)
    return net, device, torch.randn(2, 64, generator=torch.Generator().manual_seed(1))


def _on_host(net: Net, x: torch.Tensor) -> torch.Tensor:
    """What the net gives with every weight on the host (the reference)."""
    with torch.no_grad():
        for layer in reversed(net.layers) if net.reverse else net.layers:
            x = torch.nn.functional.linear(x, layer.weight.cpu().to(x.dtype), layer.bias.cpu().to(x.dtype))
    return x


def test_the_first_pass_learns_the_order_and_later_passes_copy_ahead():
    net, device, x = _streamed_net()
    lookahead = partial_model_of(net).lookahead
    streamed = sum(LOOKAHEAD in layer.__dict__ for layer in net.layers)
    assert streamed == LAYERS - 2
    first = net(device.place(x))
    assert lookahead.stats.ahead == 0 and lookahead.stats.on_demand == 2 * streamed  # weight and bias each
    second = net(device.place(x))
    assert lookahead.stats.ahead == 2 * (streamed - 1)  # all but the first streamed layer came ahead
    assert lookahead.stats.on_demand == 2 * streamed + 2
    third = net(device.place(x))
    assert lookahead.stats.ahead == 2 * (streamed - 1) + 2 * streamed  # the first too: the second pass's last
    assert lookahead.stats.on_demand == 2 * streamed + 2  # layer queued it, as a sampler's next step needs it
    assert torch.equal(first.cpu(), second.cpu()) and torch.equal(second.cpu(), _on_host(net, x))
    assert torch.equal(third.cpu(), second.cpu())


def test_copies_ahead_stay_within_the_room_the_plan_keeps_and_those_for_a_next_step_go_when_sampling_ends():
    net, device, x = _streamed_net()
    engine = partial_model_of(net)
    net(device.place(x))
    device.reset_peak()
    out = net(device.place(x))
    largest = max(layer.nbytes for layer in engine.streamed_layers())
    assert engine.lookahead.room == STREAM_COPIES * largest
    activations = 4 * out.numel() * out.element_size()  # input, output and the layer in between, with room
    assert device.peak_allocated() <= engine.resident_bytes() + STREAM_COPIES * largest + activations
    queued = engine.lookahead.in_flight_bytes  # the last layer queued the next pass's first one
    assert 0 < queued <= engine.lookahead.room
    del out
    assert prefetch.settle(net) == queued  # what the patcher's cleanup does when sampling ends
    assert engine.lookahead.in_flight_bytes == 0 and device.allocated() == engine.resident_bytes()


def test_a_model_run_once_each_time_it_is_used_queues_nothing_for_a_next_run():
    """A text encoder or a VAE (its owner turns wrapping off): the last layer of a pass copies nothing ahead, so
    nothing stays on the device after it ran, host or no host to say when its use ended."""
    net, device, x = _streamed_net()
    engine = partial_model_of(net)
    engine.lookahead.wraps = False
    for _ in range(3):
        out = net(device.place(x))
    assert engine.lookahead.stats.ahead == 2 * 2 * (LAYERS - 3)  # passes two and three: all but the first layer
    assert torch.equal(out.cpu(), _on_host(net, x)) and engine.lookahead.in_flight_bytes == 0
    del out
    assert device.allocated() == engine.resident_bytes()


@pytest.mark.parametrize(
    ("stored", "layers_ahead"),
    [(torch.float32, STREAM_COPIES - 1), (torch.float16, STREAM_COPIES - 2)],
    ids=["computes as stored", "cast to fp32"],
)
def test_the_copies_ahead_fill_the_room_the_computing_layer_leaves(stored, layers_ahead):
    """The room holds three of the largest streamed layers: a layer computing in its stored dtype takes one
    (two can come ahead), one cast to another dtype takes two (its copy and the cast: one can come ahead)."""
    net, device, x = _streamed_net(resident_layers=0, stored=stored)
    engine = partial_model_of(net)
    ahead: list[int] = []
    hooks = [
        layer.register_forward_hook(lambda *_: ahead.append(engine.lookahead.in_flight_bytes)) for layer in net.layers
    ]
    try:
        net(device.place(x))  # learns the order
        ahead.clear()
        out = net(device.place(x))
    finally:
        for hook in hooks:
            hook.remove()
    layer = engine.layers()[0].nbytes
    assert max(ahead) == layers_ahead * layer
    assert torch.equal(out.cpu(), _on_host(net, x))


def test_a_changed_order_drops_the_copies_made_for_the_old_one_and_stays_right():
    net, device, x = _streamed_net()
    lookahead = partial_model_of(net).lookahead
    net(device.place(x))
    net(device.place(x))
    net.reverse = True
    out = net(device.place(x))
    assert torch.equal(out.cpu(), _on_host(net, x))
    assert lookahead.stats.dropped >= 1
    out = net(device.place(x))  # the new order is learned
    assert torch.equal(out.cpu(), _on_host(net, x))
    before = lookahead.stats.ahead
    out = net(device.place(x))
    assert lookahead.stats.ahead - before == 2 * (LAYERS - 2)  # every streamed layer came ahead in the new order
    assert torch.equal(out.cpu(), _on_host(net, x))


def test_a_weight_changed_after_its_copy_was_queued_is_copied_again():
    net, device, x = _streamed_net(resident_layers=0)
    net(device.place(x))

    def change_the_next_weight(_module, _args, _out):  # runs after layer 0 queued layer 1's copy
        with torch.no_grad():
            net.layers[1].weight.add_(1.0)

    handle = net.layers[0].register_forward_hook(change_the_next_weight)
    try:
        out = net(device.place(x))
    finally:
        handle.remove()
    assert torch.equal(out.cpu(), _on_host(net, x))


def test_a_weight_replaced_between_passes_is_copied_ahead_from_the_next_pass_on():
    """The pieces each layer copies are found once and kept while they hold; a weight replaced by a new tensor (as
    a host's patcher sets a patched parameter), or a patch function added, is seen when its layer is reached: that
    pass copies it when used, and every later one copies everything ahead again."""
    net, device, x = _streamed_net(resident_layers=0)
    lookahead = partial_model_of(net).lookahead
    net(device.place(x))
    net(device.place(x))
    with torch.no_grad():
        net.layers[3].weight = torch.nn.Parameter(net.layers[3].weight * 3.0, requires_grad=False)
    net.layers[5].weight_function = [lambda weight: weight.mul_(2.0)]
    out = net(device.place(x))
    expected = _on_host(net, x)  # layer 5's patch is not applied by the reference: compare the next passes
    assert not torch.equal(out.cpu(), expected)
    before = lookahead.stats.ahead
    second = net(device.place(x))
    assert lookahead.stats.ahead - before == 2 * LAYERS  # every layer came ahead again (the first at the end of the
    # pass before)
    assert torch.equal(second.cpu(), out.cpu())
    net.layers[5].weight_function = []
    assert torch.equal(net(device.place(x)).cpu(), expected)


def test_a_patch_function_never_changes_the_stored_weight_through_a_prefetched_copy():
    """On the simulated GPU a copy may share the host's memory; a weight a patch will change is copied privately."""
    net, device, x = _streamed_net(resident_layers=0)
    stored = [layer.weight.detach().clone() for layer in net.layers]
    for layer in net.layers:
        layer.weight_function = [lambda weight: weight.mul_(2.0)]
    for _ in range(3):
        out = net(device.place(x))
    assert all(torch.equal(layer.weight.detach(), kept) for layer, kept in zip(net.layers, stored, strict=True))
    with torch.no_grad():
        expected = x
        for kept, layer in zip(stored, net.layers, strict=True):
            expected = torch.nn.functional.linear(expected, kept * 2.0, layer.bias.detach())
    assert torch.equal(out.cpu(), expected)


def test_a_prefetched_copy_used_without_waiting_is_caught(monkeypatch):
    net, device, x = _streamed_net()
    net(device.place(x))
    monkeypatch.setattr(type(backend_of(device)), "wait", lambda self, stream, event: None)
    with pytest.raises(MissingWaitError):
        net(device.place(x))


def test_moving_the_model_drops_every_queued_copy_and_its_marks():
    net, device, x = _streamed_net()
    engine = partial_model_of(net)
    net(device.place(x))
    engine.lookahead.before_use(engine.streamed_layers()[0].module, device)  # copies queued, then the model moves
    assert engine.lookahead.in_flight_bytes > 0
    engine.unload_all()
    assert engine.lookahead.in_flight_bytes == 0 and device.allocated() == 0
    assert not any(LOOKAHEAD in layer.__dict__ for layer in net.layers)


def test_prefetch_turned_off_copies_each_weight_when_used(monkeypatch):
    monkeypatch.setattr(prefetch, "_enabled", False)
    net, device, x = _streamed_net()
    assert not any(LOOKAHEAD in layer.__dict__ for layer in net.layers)
    net(device.place(x))
    out = net(device.place(x))
    assert partial_model_of(net).lookahead.stats.ahead == 0
    assert torch.equal(out.cpu(), _on_host(net, x))


@pytest.mark.parametrize(("text", "enabled"), [("", True), ("on", True), ("OFF", False), ("0", False)])
def test_the_setting_reads_on_and_off(text, enabled):
    assert prefetch.prefetch_from_env({prefetch.PREFETCH_ENV: text}) is enabled


def test_a_malformed_setting_names_the_fix():
    with pytest.raises(InvalidSizeError, match="DEVICE_CONTROL_PREFETCH=off"):
        prefetch.prefetch_from_env({prefetch.PREFETCH_ENV: "sometimes"})


def test_weights_made_in_inference_mode_are_prefetched_too():
    """ComfyUI builds and patches models in inference mode, where tensors keep no version counter."""
    with torch.inference_mode():
        net, device, x = _streamed_net()
        net(device.place(x))
        out = net(device.place(x))
    assert partial_model_of(net).lookahead.stats.ahead > 0
    assert torch.equal(out.cpu(), _on_host(net, x))


# -- layers streamed in row slices -------------------------------------------------------------------------------


class WideNet(torch.nn.Module):
    """Six 4 MiB cast linears: under a 9 MiB budget one stays resident and the others stream in 1 MiB slices."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(ops.Linear(1024, 1024) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) * 0.05
        return x


def _sliced_net() -> tuple[WideNet, SimulatedDevice, torch.Tensor, torch.Tensor]:
    net, device = WideNet(), SimulatedDevice(64 * MiB)
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = net(x)
    report = partial_model_of(net).load(device, 9 * MiB)
    assert len(report.plan.slices) == 5 and all(len(s.ranges()) > 3 for s in report.plan.slices.values())
    return net, device, x, reference


def test_slices_are_copied_ahead_slice_after_slice_and_layer_after_layer_within_the_reserve():
    net, device, x, reference = _sliced_net()
    engine = partial_model_of(net)
    with torch.no_grad():
        first = net(device.place(x))
        ahead_in_first_pass = engine.lookahead.stats.ahead
        device.reset_peak()
        second = net(device.place(x))
    pieces = sum(len(s.ranges()) + 1 for s in engine.plan.slices.values())  # the slices, and each bias
    assert ahead_in_first_pass > 0  # a layer's next slices are known before the order of layers is
    assert engine.lookahead.stats.ahead - ahead_in_first_pass == pieces - 2  # all but the first layer's first
    assert torch.equal(device.release(first).clone(), reference) and torch.equal(
        device.release(second).clone(), reference
    )
    activations = 4 * 4 * 1024 * 4  # input, output and the slice's part, with room
    assert engine.plan.reserve_bytes <= 3 * MiB + 3 * 4096
    assert device.peak_allocated() <= engine.resident_bytes() + engine.plan.reserve_bytes + activations
    queued = engine.lookahead.in_flight_bytes  # the next pass's first slices, queued by this one's last
    assert 0 < queued <= engine.plan.reserve_bytes
    del first, second
    assert prefetch.settle(net) == queued and device.allocated() == engine.resident_bytes()


def test_a_sliced_copy_used_without_waiting_is_caught(monkeypatch):
    net, device, x, _reference = _sliced_net()
    with torch.no_grad():
        net(device.place(x))
        monkeypatch.setattr(type(backend_of(device)), "wait", lambda self, stream, event: None)
        with pytest.raises(MissingWaitError):
            net(device.place(x))
