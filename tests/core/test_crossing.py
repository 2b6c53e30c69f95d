"""A model placed on another simulated GPU than its caller (a ControlNet beside its diffusion model): its call's
tensors cross to it, its residuals come back, its weights stay; without the hooks the call fails as CUDA's does."""

from __future__ import annotations

import pytest
import torch

from core.devices.sim.device import SimulatedDevice
from core.devices.sim.tensor import SimTensor
from core.devices.tensors import HOST, copied_onto, label_of
from core.placement.crossing import cross_to_placement
from core.placement.engine import partial_model_of
from core.weights import ops
from tests.core.small_net import reserve_of, width

MiB = 1024**2


class Residuals(torch.nn.Module):
    """A ControlNet's shape of call and answer: keyword tensors in, a dictionary of lists of tensors out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = torch.nn.Sequential(*(ops.Linear(width(), width()) for _ in range(6)))
        self.middle = ops.Linear(width(), width())

    def forward(self, x: torch.Tensor, hint: torch.Tensor, timesteps: torch.Tensor) -> dict[str, list]:
        h = self.inner(x + hint) * timesteps
        return {"output": [h, None], "middle": [self.middle(h)]}


def _inputs(device: SimulatedDevice) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {name: device.place(torch.randn(2, width(), generator=generator)) for name in ("x", "hint")} | {
        "timesteps": device.place(torch.ones(2, 1))
    }


def _on_host(net: Residuals, inputs: dict[str, torch.Tensor]) -> dict[str, list]:
    with torch.no_grad():
        return net(**{name: value.cpu() for name, value in inputs.items()})


def _onto(device: SimulatedDevice) -> int:
    return copied_onto().get(label_of(device), 0)


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
def test_a_model_on_the_second_gpu_answers_a_caller_on_the_first_and_its_weights_stay(streamed):
    caller, placed = SimulatedDevice(64 * MiB, ordinal=0), SimulatedDevice(64 * MiB, ordinal=1)
    net = Residuals()
    engine = partial_model_of(net)
    engine.load(placed, engine.total_bytes() if not streamed else reserve_of(engine.layers()[:1]))
    assert bool(engine.streamed_layers()) == streamed
    inputs = _inputs(caller)
    layer = engine.layers()[0].nbytes
    before = _onto(caller)
    with torch.no_grad():  # without the crossing, as CUDA: a mismatch, or the weights streamed to the caller's GPU
        if streamed:
            net(**inputs)
            assert _onto(caller) - before >= layer
        else:
            with pytest.raises(RuntimeError, match="same device"):
                net(**inputs)
    cross_to_placement(net)
    cross_to_placement(net)  # once per module: a second placement adds no second crossing
    expected = _on_host(net, inputs)
    before = _onto(caller)
    with torch.no_grad():
        out = net(**inputs)
    assert _onto(caller) - before == 2 * inputs["x"].nbytes < layer  # the two residuals came back, no weight
    assert out["output"][1] is None
    assert all(isinstance(t, SimTensor) and t.sim_device is caller for t in (out["output"][0], out["middle"][0]))
    assert torch.equal(out["output"][0].cpu(), expected["output"][0])
    assert torch.equal(out["middle"][0].cpu(), expected["middle"][0])
    assert engine.holds(placed)  # the weights are where they were placed


def test_a_model_its_engine_no_longer_holds_runs_where_it_is_called():
    placed = SimulatedDevice(64 * MiB, ordinal=1)
    net = Residuals()
    engine = partial_model_of(net)
    engine.load(placed, engine.total_bytes())
    cross_to_placement(net)
    net.to("cpu")  # loaded another way since (the host application's own loader, back to RAM)
    assert not engine.holds(placed)
    inputs = {name: value.cpu() for name, value in _inputs(SimulatedDevice(64 * MiB, ordinal=0)).items()}
    with torch.no_grad():
        out = net(**inputs)
    assert out["output"][0].device == HOST  # the call stayed on the host, beside the weights
