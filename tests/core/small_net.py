"""A small model for the engine's tests: two big layers among small ones, a norm and a layer that cannot
stream, in a known order; and how to run it on a simulated GPU."""

from __future__ import annotations

import torch

from core.devices.host_memory import page_size
from core.devices.sim.device import SimulatedDevice
from core.devices.sim.tensor import SimTensor
from core.placement.plan import Layer, layers_of, stream_reserve
from core.placement.slabs import layer_bytes
from core.weights import ops


def width() -> int:
    """The width of the small nets' layers: 64 on hosts of 4 KiB pages, wider on hosts of larger pages (a ring slot
    holds each tensor on pages of its own, as its host slab does), so a layer takes as many pages on every
    platform."""
    return 64 * round((page_size() // 4096) ** 0.5)


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
        wide = width()
        self.first = ops.Linear(wide, wide)
        self.norm = ops.LayerNorm(wide)
        self.middle = ops.Linear(wide, 8 * wide)
        self.fixed = Scale(8 * wide)
        self.back = ops.Linear(8 * wide, wide)
        self.tail = torch.nn.Sequential(*(ops.Linear(wide, wide) for _ in range(6)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.first(x))
        x = self.fixed(torch.relu(self.middle(x)))
        return self.tail(torch.relu(self.back(x)))


def partial_budget(net: Net) -> int:
    """Room for the big layers and the fixed one; the small ones stream."""
    size = sizes(net)
    first = next(layer for layer in layers_of(net) if layer.name == "first")
    return size["fixed"] + size["middle"] + size["back"] + size["norm"] + reserve_of([first])


def reserve_of(layers: list[Layer]) -> int:
    """The streaming reserve a plan keeps for streaming ``layers`` whole: their pieces as a ring slot holds them
    (each tensor on pages of its own, as in its host slab) and one made ready to compute."""
    return stream_reserve(max(layer_bytes(layer.module) for layer in layers), max(layer.nbytes for layer in layers))


def sizes(net: torch.nn.Module) -> dict[str, int]:
    return {layer.name: layer.nbytes for layer in layers_of(net)}


def run(net: Net, x: torch.Tensor, device: SimulatedDevice) -> torch.Tensor:
    out = net(device.place(x))
    assert isinstance(out, SimTensor) and out.sim_device is device  # it computed on the device
    return device.release(out).clone()
