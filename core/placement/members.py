"""What a ring keeps for each of its layers, and what it counts (``core.placement.ring``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..devices.backends import Target
from .slabs import Part

if TYPE_CHECKING:
    from .ring import Ring


@dataclass(eq=False)
class Member:
    """A streamed layer of a ring: its module, its group, where its weight and bias lie, and their views in each
    slot."""

    ring: Ring
    module: torch.nn.Module
    group: int
    weight: Part | None
    bias: Part | None
    views: list[tuple[torch.Tensor | None, torch.Tensor | None]] = field(default_factory=list)

    def fetch(self, target: Target) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """This layer's weight and bias on ``target``, their copy waited for by the compute stream; ``None`` when
        the ring serves another device (the caller copies the layer's tensors as usual)."""
        return self.ring.fetch(self, target)

    def views_in(self, buffer: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This layer's weight and bias as views of ``buffer`` (a ring slot), where they lie in its group."""
        return (
            self.weight.view(buffer) if self.weight is not None else None,
            self.bias.view(buffer) if self.bias is not None else None,
        )


@dataclass
class RingStats:
    """What the ring did: groups copied (``copies``), of which ahead of use (``ahead``) and through a staging
    buffer (``staged``), bytes copied, groups found in a slot already when reached (``hits``), and times the groups
    were packed again in the order the model runs in (``reordered``)."""

    copies: int = 0
    ahead: int = 0
    nbytes: int = 0
    hits: int = 0
    staged: int = 0
    reordered: int = 0
