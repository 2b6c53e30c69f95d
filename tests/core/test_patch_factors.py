"""LoRA factors of streamed and quantised layers cross to the device once per load, all of a load's in one block from
page-locked memory, and are given back when the layers stop streaming (``core.weights.patch_factors``); the plan
keeps room for them.

Left in host memory, the factors crossed at every forward of every patched streamed layer, each crossing a blocking
copy (a device synchronisation on CUDA). The simulated GPU counts every copy over its link.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from core.devices.host_memory import page_size
from core.devices.pinned import pinned_memory
from core.devices.sim.device import SimulatedDevice
from core.placement.engine import partial_model_of
from core.placement.plan import Layer, plan_layers
from core.placement.streaming import LayerHooks
from core.weights import ops
from core.weights.patch_factors import FactorBank, factor_bytes
from core.weights.patch_math import calculate_weight
from core.weights.patching import OnTheFlyPatch
from tests.core.order_net import LAYERS, Net
from tests.core.platform_marks import STREAMS_AND_PINNING
from tests.core.small_net import width
from tests.core.test_quantized_layers import _quantise

MiB = 1024**2


class OnTheFly(LayerHooks):
    """The owner's side as ComfyUI's patcher plays it (``nodes.bridge.layer_hooks``): each streamed layer's weight
    patched as it is cast, the load's patches placing their factors through one bank."""

    def __init__(self, patches: dict) -> None:
        self.patches = patches
        self.bank = FactorBank()

    def on_streamed(self, layer: Layer) -> None:
        key = f"{layer.name}.weight"
        if key in self.patches:
            module = layer.module
            patch = OnTheFlyPatch(key, self.patches, storage_dtype=module.weight.dtype)
            self.bank.join(patch)
            module.weight_function.append(patch)

    def patch_bytes(self) -> dict[str, int]:
        return {key.rpartition(".")[0]: factor_bytes(patches) for key, patches in self.patches.items()}


def _lora(rows: int, columns: int, seed: int, strength: float = 0.8) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    up, down = torch.randn(rows, 4, generator=generator), torch.randn(4, columns, generator=generator)
    return (strength, SimpleNamespace(name="lora", weights=(up, down, 2.0, None, None, None)), 1.0, None, None)


def _patched_net(patched: bool) -> tuple[Net, SimulatedDevice, dict]:
    """The net on a simulated GPU with every layer streaming, each weight with a LoRA when ``patched``."""
    net, device = Net(), SimulatedDevice(64 * MiB)
    patches = {f"layers.{i}.weight": [_lora(width(), width(), i)] for i in range(LAYERS)} if patched else {}
    partial_model_of(net).load(device, 0, hooks=OnTheFly(patches))
    return net, device, patches


def _copies_per_pass(net: Net, device: SimulatedDevice, passes: int = 3) -> list[int]:
    x = torch.randn(2, width(), generator=torch.Generator().manual_seed(1))
    counts = []
    with torch.no_grad():
        for _ in range(passes):
            before = device.link.copies
            net(device.place(x))
            counts.append(device.link.copies - before - 1)  # the input's own copy aside
    return counts


@pytest.mark.parametrize("pinning", ["within the pinned cap", "past the pinned cap"])
def test_lora_factors_cross_once_per_load_then_never_again_while_the_layers_stream(pinning, monkeypatch):
    """Past the pinned cap (slabs filled it) the one block crosses in one blocking copy a load, not one a layer."""
    if pinning != "within the pinned cap":
        monkeypatch.setattr(pinned_memory(), "max_bytes", 0)
    plain = _copies_per_pass(*_patched_net(False)[:2])
    net, device, patches = _patched_net(True)
    patched = _copies_per_pass(net, device)
    # One copy in the first pass (every layer's factors in one block), none in the passes after: before, one copy
    # per patched layer in the first pass, and before that two blocking copies per patched layer in every pass.
    assert patched[0] - plain[0] == 1 and patched[1:] == plain[1:]
    engine = partial_model_of(net)
    engine.unload_all()
    engine.load(device, 0, hooks=OnTheFly(patches))
    assert _copies_per_pass(net, device, 2) == patched[:2]  # a new load: they cross once again


def test_the_patched_streamed_net_computes_the_host_patched_weights_bit_for_bit():
    net, device, patches = _patched_net(True)
    x = torch.randn(2, width(), generator=torch.Generator().manual_seed(1))
    expected = x
    for i, layer in enumerate(net.layers):
        weight = calculate_weight(patches[f"layers.{i}.weight"], layer.weight.detach().clone(), f"layers.{i}.weight")
        expected = torch.nn.functional.linear(expected, weight, layer.bias.detach())
    with torch.no_grad():
        for _ in range(2):  # factors crossing, then kept
            assert torch.equal(device.release(net(device.place(x))), expected)


@STREAMS_AND_PINNING
def test_factors_are_page_locked_while_kept_and_given_back_when_the_model_unloads():
    pinned, kept, left = pinned_memory(), {}, {}
    for patched in (False, True):
        gc.collect()  # models of earlier tests give their locked memory back now, not in the middle
        net, device, _patches = _patched_net(patched)
        before = pinned.pinned_bytes, device.allocated()
        _copies_per_pass(net, device, 1)
        kept[patched] = pinned.pinned_bytes - before[0], device.allocated() - before[1]
        partial_model_of(net).unload_all()
        del net
        gc.collect()
        left[patched] = pinned.pinned_bytes - before[0]
        assert device.allocated() == 0
    factors = LAYERS * 2 * width() * 4 * 4  # up and down in float32
    assert kept[True][0] - kept[False][0] == -(-factors // page_size()) * page_size()  # one page-locked block
    assert kept[True][1] - kept[False][1] == factors  # on the device
    assert left[True] == left[False]  # given back with the model's own


def test_a_patch_added_later_crosses_once_and_applies():
    plain = _copies_per_pass(*_patched_net(False)[:2])
    net, device, patches = _patched_net(True)
    _copies_per_pass(net, device, 1)
    patches["layers.3.weight"].append(_lora(width(), width(), 99, strength=0.5))  # as ComfyUI's add_patches appends
    assert _copies_per_pass(net, device, 2) == [plain[1] + 1, plain[2]]  # that layer's factors, all, once
    layer = net.layers[3]
    weight = calculate_weight(patches["layers.3.weight"], layer.weight.detach().clone(), "layers.3.weight")
    assert torch.equal(layer.weight_function[0](device.place(layer.weight.detach().clone())).cpu(), weight)


def test_a_quantised_layer_patched_on_the_fly_keeps_its_factors_on_the_device_resident_or_streamed():
    """A GGUF layer's patches apply to its dequantised weight at every forward, resident or streamed."""
    device = SimulatedDevice(64 * MiB)
    x = device.place(torch.randn(3, 256))
    counts = {}
    for resident in (True, False):
        for patched in (False, True):
            torch.manual_seed(4)
            model = torch.nn.Sequential(ops.Linear(256, 128))
            _quantise(model[0], "Q8_0")
            engine = partial_model_of(model)
            engine.load(device, engine.total_bytes() if resident else 0)
            if patched:
                model[0].weight_function = [OnTheFlyPatch("0.weight", {"0.weight": [_lora(128, 256, 3)]})]
            counts[resident, patched] = []
            with torch.no_grad():
                for _ in range(3):
                    before = device.link.copies
                    model(x)
                    counts[resident, patched].append(device.link.copies - before)
            engine.unload_all()
    for resident in (True, False):
        plain, patched = counts[resident, False], counts[resident, True]
        assert patched[0] == plain[0] + 1 and patched[1:] == plain[1:], (resident, plain, patched)


def test_the_plan_keeps_room_for_the_factors_of_the_layers_it_streams():
    net = Net()
    layers = partial_model_of(net).layers()
    extras = {layer.name: 1_000 for layer in layers}
    everything = sum(layer.nbytes for layer in layers)
    assert plan_layers(layers, everything, extras=extras).patch_bytes == 0  # all resident: nothing kept beside
    budget = everything // 2
    plan = plan_layers(layers, budget, extras=extras)
    assert plan.patch_bytes == 1_000 * plan.streamed_layers > 0
    assert plan.needed_bytes <= budget
    without = plan_layers(layers, budget)
    assert plan.resident_bytes <= without.resident_bytes
