"""Loading a model again as its last load left it, as every sampling call does, costs no planning and no moves:
the engine sees cheaply that the tree is as it left it; a tree moved since is read from its tensors again."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

from core.devices.sim.device import SimulatedDevice
from core.devices.sim.tensor import SimTensor
from core.placement.engine import partial_model_of
from core.weights import ops

MiB = 1024**2
LAYERS = 200
CORE = str(Path(__file__).resolve().parents[2] / "core") + "/"


def _calls_in_core(run: Callable[[], object]) -> int:
    """Python calls into ``core/`` while ``run`` runs, the simulated device's own modules left out (the count
    ``tools/bench/host.py`` makes of a sampling call)."""
    calls = 0

    def profile(frame, event, _arg):
        nonlocal calls
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(CORE) and "/devices/sim" not in name and "simulated.py" not in name:
            calls += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def _streaming_half() -> tuple[torch.nn.Sequential, SimulatedDevice, int]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(*(ops.Linear(64, 64) for _ in range(LAYERS)))
    device = SimulatedDevice(64 * MiB)
    budget = partial_model_of(net).total_bytes() // 2
    return net, device, budget


def test_loading_again_as_left_does_no_work_a_layer():
    net, device, budget = _streaming_half()
    engine = partial_model_of(net)
    first = engine.load(device, budget)
    assert 0 < first.resident_bytes < first.total_bytes  # it streams
    with torch.inference_mode():
        net(device.place(torch.randn(2, 64)))  # a forward between, as a sampling call makes
    allocated = device.allocated()
    again = engine.load(device, budget)
    calls = _calls_in_core(lambda: engine.load(device, budget))
    # The owner is still asked once a layer which rows its patches allow (they may have changed); nothing else
    # is done a layer. Planning and applying the plan again took about a hundred calls a layer.
    assert calls < LAYERS + 50, calls
    assert again.plan is first.plan and again.resident_bytes == first.resident_bytes and not again.moved_in
    assert device.allocated() == allocated
    assert engine.holds(device) and engine.resident_bytes(device) == sum(
        layer.nbytes for layer in engine.layers() if layer.is_resident(device)
    )


def test_a_weight_moved_by_another_loader_is_noticed_and_put_back():
    net, device, budget = _streaming_half()
    engine = partial_model_of(net)
    engine.load(device, budget)
    resident = next(layer for layer in engine.layers() if layer.is_resident(device))
    resident.module.to("cpu")  # as ComfyUI's own loader moves a module it manages
    assert not isinstance(resident.module.weight, SimTensor)
    assert not engine.holds(device) and engine.resident_bytes(device) < engine.plan.resident_bytes
    report = engine.load(device, budget)
    assert resident.is_resident(device) and engine.holds(device)
    assert report.resident_bytes == engine.plan.resident_bytes and report.moved_in == resident.nbytes


def test_a_streamed_layer_made_resident_elsewhere_is_noticed():
    """ComfyUI's unpatch wipes a streamed layer's cast marks: the tree is no longer as the engine left it."""
    net, device, budget = _streaming_half()
    engine = partial_model_of(net)
    engine.load(device, budget)
    streamed = engine.streamed_layers()[0]
    del streamed.module.prev_comfy_cast_weights
    assert not engine.holds(device)
    engine.load(device, budget)
    assert engine.holds(device) and hasattr(streamed.module, "prev_comfy_cast_weights")
