"""A small model for the engine's tests: two big layers among small ones, a norm and a layer that cannot
stream, in a known order; and how to run it on a simulated GPU."""

from __future__ import annotations

import torch

from core.devices.simtensor import SimTensor
from core.devices.simulated import SimulatedDevice
from core.placement.plan import STREAM_COPIES, layers_of
from core.weights import ops


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


def run(net: Net, x: torch.Tensor, device: SimulatedDevice) -> torch.Tensor:
    out = net(device.place(x))
    assert isinstance(out, SimTensor) and out.sim_device is device  # it computed on the device
    return device.release(out).clone()
