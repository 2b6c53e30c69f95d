"""A model whose order can change, for the streaming tests (the ring's and the per-tensor prefetch's): eight cast
linears run forwards or backwards, put on a simulated GPU with some layers resident and the rest streaming."""

from __future__ import annotations

import torch

from core.devices.sim.cost import LinkCost
from core.devices.sim.device import SimulatedDevice
from core.placement.engine import partial_model_of
from core.weights import ops
from tests.core.small_net import reserve_of, width

MiB = 1024**2
LAYERS = 8


class Net(torch.nn.Module):
    """Eight cast linears, run forwards or (``reverse``) backwards, leaving out the layers numbered in ``skipped``
    (as skip-layer guidance leaves out blocks in one of its calls): a model whose order can change."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(ops.Linear(width(), width()) for _ in range(LAYERS))
        self.reverse = False
        self.skipped: frozenset[int] = frozenset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in _running(self):
            x = layer(x)
        return x


def _running(net: Net) -> list[torch.nn.Module]:
    """The layers ``net`` runs, in the order it runs them."""
    layers = [layer for number, layer in enumerate(net.layers) if number not in net.skipped]
    return layers[::-1] if net.reverse else layers


def streamed_net(
    resident_layers: int = 2, stored: torch.dtype = torch.float32, link: LinkCost | None = None
) -> tuple[Net, SimulatedDevice, torch.Tensor]:
    """The net (its weights in ``stored``) with its ``resident_layers`` largest-first layers on a simulated GPU
    (with ``link``), the rest streaming; the input is fp32."""
    device = SimulatedDevice(64 * MiB, link=link)
    net = Net().to(stored)
    engine = partial_model_of(net)
    engine.load(device, resident_layers * engine.layers()[0].nbytes + reserve_of(engine.layers()[:1]))
    return net, device, torch.randn(2, width(), generator=torch.Generator().manual_seed(1))


def on_host(net: Net, x: torch.Tensor) -> torch.Tensor:
    """What the net gives with every weight on the host (the reference)."""
    with torch.no_grad():
        for layer in _running(net):
            x = torch.nn.functional.linear(x, layer.weight.cpu().to(x.dtype), layer.bias.cpu().to(x.dtype))
    return x
