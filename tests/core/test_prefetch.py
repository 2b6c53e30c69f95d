"""Prefetch through the one streaming engine, the ring: layers streamed in row slices cross slice by slice as
groups of the ring, the next copied while the current one computes, within the room the plan keeps, and never at
the cost of a wrong result (layers streamed whole: ``test_ring.py``); the setting that turns prefetch off.

These run the product's engine and cast layers on a simulated GPU, whose streams check that every copy is
waited for before it is used (a missing wait raises), so a prefetched weight used too early fails here.
"""

from __future__ import annotations

import gc

import pytest
import torch

from core.devices.backends import backend_of
from core.devices.sim.device import SimulatedDevice
from core.devices.sim.link import MissingWaitError
from core.devices.transfer import GROUPED
from core.errors import InvalidSizeError
from core.placement import prefetch, rings
from core.placement.engine import partial_model_of
from core.weights import ops
from tests.core.order_net import MiB, on_host, streamed_net
from tests.core.platform_marks import STREAMS_AND_PINNING


def test_a_patch_function_never_changes_the_stored_weight_through_a_prefetched_copy():
    """On the simulated GPU a copy may share the host's memory; a weight a patch will change is copied privately."""
    net, device, x = streamed_net(resident_layers=0)
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


@STREAMS_AND_PINNING
def test_a_prefetched_copy_used_without_waiting_is_caught(monkeypatch):
    net, device, x = streamed_net()
    net(device.place(x))
    monkeypatch.setattr(type(backend_of(device)), "wait", lambda self, stream, event: None)
    with pytest.raises(MissingWaitError):
        net(device.place(x))


def test_moving_the_model_waits_for_the_copies_in_flight_and_drops_its_marks():
    net, device, x = streamed_net()
    engine = partial_model_of(net)
    net(device.place(x))  # its last group copied the next pass's first ahead: in flight when the model moves
    assert engine.ring.ring_bytes > 0
    engine.unload_all()
    assert engine.ring.ring_bytes == 0 and device.allocated() == 0
    assert not any(GROUPED in layer.__dict__ for layer in net.layers)


def test_prefetch_turned_off_copies_each_group_when_reached(monkeypatch):
    monkeypatch.setattr(prefetch, "_enabled", False)
    net, device, x = streamed_net()
    net(device.place(x))
    out = net(device.place(x))
    ring = partial_model_of(net).ring
    assert ring.slots == 1 and ring.stats.ahead == 0
    assert torch.equal(out.cpu(), on_host(net, x))


@pytest.mark.parametrize(("text", "enabled"), [("", True), ("on", True), ("OFF", False), ("0", False)])
def test_the_setting_reads_on_and_off(text, enabled):
    assert prefetch.prefetch_from_env({prefetch.PREFETCH_ENV: text}) is enabled


def test_a_malformed_setting_names_the_fix():
    with pytest.raises(InvalidSizeError, match="DEVICE_CONTROL_PREFETCH=off"):
        prefetch.prefetch_from_env({prefetch.PREFETCH_ENV: "sometimes"})


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


def test_slices_are_groups_of_the_ring_copied_ahead_one_after_another_within_the_reserve():
    net, device, x, reference = _sliced_net()
    engine = partial_model_of(net)
    ring = engine.ring
    assert all(GROUPED in net.layers[i].__dict__ for i in range(6) if f"layers.{i}" in engine.plan.slices)
    assert len(ring._groups) == sum(len(s.ranges()) for s in engine.plan.slices.values())  # a group per slice
    with torch.no_grad():
        first = net(device.place(x))
        second = net(device.place(x))
        copies, ahead = ring.stats.copies, ring.stats.ahead
        device.reset_peak()
        third = net(device.place(x))
    assert ring.stats.copies - copies == len(ring._groups)  # each slice once a pass
    assert ring.stats.ahead - ahead == len(ring._groups)  # every one ahead, the next pass's first included
    for out in (first, second, third):
        assert torch.equal(device.release(out).clone(), reference)
    activations = 4 * 4 * 1024 * 4  # input, output and the slice's part, with room
    assert engine.plan.reserve_bytes <= 3 * MiB + 3 * 4096
    assert device.peak_allocated() <= engine.resident_bytes() + engine.plan.reserve_bytes + activations
    del first, second, third, out
    gc.collect()
    held = ring.ring_bytes
    assert held > 0 and rings.settle(net) == held
    assert ring.ring_bytes == 0 and device.allocated() == engine.resident_bytes()


@STREAMS_AND_PINNING
def test_a_sliced_copy_used_without_waiting_is_caught(monkeypatch):
    net, device, x, _reference = _sliced_net()
    with torch.no_grad():
        net(device.place(x))
        monkeypatch.setattr(type(backend_of(device)), "wait", lambda self, stream, event: None)
        with pytest.raises(MissingWaitError):
            net(device.place(x))
