"""A split model in pipeline mode on two simulated GPUs and the CPU: each part's bytes on its device, the same
output as on one device bit for bit, the output back on the caller's device, and only activations moving."""

from __future__ import annotations

import gc

import pytest
import torch

from core.devices.simtensor import SimTensor
from core.devices.simulated import SimulatedDevice
from core.devices.tensors import HOST
from core.placement.allocation import parse_allocation
from core.placement.pipeline import attach_hops, place_split
from core.placement.plan import layers_of
from core.placement.split import blocks_of, split_blocks
from core.weights import ops

WIDTH = 32


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = ops.Linear(WIDTH, WIDTH)
        self.norm = ops.LayerNorm(WIDTH)
        self.mlp = torch.nn.Sequential(ops.Linear(WIDTH, 2 * WIDTH), torch.nn.GELU(), ops.Linear(2 * WIDTH, WIDTH))

    def forward(self, img: torch.Tensor, vec: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
        x = self.norm(img + self.attn(img) * vec.unsqueeze(1) + pe)
        return x + self.mlp(x)


class Final(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.modulation = ops.Linear(WIDTH, WIDTH)
        self.linear = ops.Linear(WIDTH, 8)

    def forward(self, img: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        return self.linear(img * (1 + self.modulation(vec).unsqueeze(1)))


class FluxShaped(torch.nn.Module):
    """What a Flux model does between its blocks: embeddings computed once and given to every block, two lists
    of blocks with a join between them, a final layer given the hidden state and the embedding."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.img_in = ops.Linear(8, WIDTH)
        self.time_in = ops.Linear(4, WIDTH)
        self.double_blocks = torch.nn.ModuleList(Block() for _ in range(4))
        self.single_blocks = torch.nn.ModuleList(Block() for _ in range(4))
        self.final_layer = Final()

    def forward(self, img: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        vec = self.time_in(t)
        img = self.img_in(img)
        pe = torch.sin(img[:1] * 0.5)  # computed once at the start, handed to every block
        for block in self.double_blocks:
            img = block(img, vec, pe=pe)
        img = torch.cat((img[:, :2], img[:, 2:]), dim=1)  # a join between the lists, on one part's tensors
        for block in self.single_blocks:
            img = block(img, vec, pe=pe)
        return self.final_layer(img, vec)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(2, 6, 8, generator=generator), torch.randn(2, 4, generator=generator)


def _split(net: torch.nn.Module, text: str):
    return split_blocks(blocks_of(net, layers_of(net)), parse_allocation(text))


@pytest.mark.parametrize(
    "allocation", ["gpu:0=40%, gpu:1=60%", "gpu:0=30%, gpu:1=30%, cpu=*"], ids=["two GPUs", "a CPU remainder"]
)
def test_each_part_computes_where_it_lives_and_the_output_is_the_one_device_output_bit_for_bit(allocation):
    net = FluxShaped()
    img, t = _inputs()
    with torch.no_grad():
        expected = net(img, t)
    gpus = SimulatedDevice(1 << 30, ordinal=0), SimulatedDevice(1 << 30, ordinal=1)
    targets = {"gpu:0": gpus[0], "gpu:1": gpus[1], "cpu": HOST}
    split = _split(net, allocation)
    place_split(split, targets)
    for part, device in zip(split.parts, gpus, strict=False):  # each device holds its part's bytes, no more
        assert 0 < part.nbytes == device.allocated()
    hops = attach_hops(net, split, targets, home=gpus[0])
    with torch.no_grad():
        out = net(gpus[0].place(img), gpus[0].place(t))
    assert isinstance(out, SimTensor) and out.sim_device is gpus[0]  # back on the caller's device
    assert torch.equal(out.cpu(), expected)
    del out
    gc.collect()
    for part, device in zip(split.parts, gpus, strict=False):  # activations gone, weights where they were
        assert device.allocated() == part.nbytes
    if len(split.parts) == 3:
        assert split.parts[2].nbytes > 0 and all(p.device.type == "cpu" for p in net.final_layer.parameters())
    hops.remove()
    with torch.no_grad(), pytest.raises(RuntimeError, match="same device"):  # the hops did the moving
        net(gpus[0].place(img), gpus[0].place(t))
