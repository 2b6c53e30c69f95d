"""A Flux-shaped model of ``core.weights.ops`` layers for the split tests: what a Flux model does between its
blocks (embeddings computed once and given to every block, two lists of blocks with a join between them, a final
layer given the hidden state and the embedding), small enough to run on the CPU."""

from __future__ import annotations

import torch

from core.placement.allocation import parse_allocation
from core.placement.plan import layers_of
from core.placement.split import Split, blocks_of, split_blocks
from core.weights import ops
from tests.core.small_net import width

#: 32 on hosts of 4 KiB pages, wider on larger pages, so a layer takes as many pages in a slab on every platform.
WIDTH = width() // 2


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

    def __init__(self, double: int = 4, single: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.img_in = ops.Linear(8, WIDTH)
        self.time_in = ops.Linear(4, WIDTH)
        self.double_blocks = torch.nn.ModuleList(Block() for _ in range(double))
        self.single_blocks = torch.nn.ModuleList(Block() for _ in range(single))
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


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(2, 6, 8, generator=generator), torch.randn(2, 4, generator=generator)


def split_of(net: torch.nn.Module, text: str) -> Split:
    """``net`` split by the allocation ``text``."""
    return split_blocks(blocks_of(net, layers_of(net)), parse_allocation(text))
