"""What a ring keeps for each of its layers, and what it counts (``core.placement.ring``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Protocol

import torch

from .slabs import Part, Slab, tensors_of

if TYPE_CHECKING:
    from ..devices.backends import Target


class Fetcher(Protocol):
    """What a layer asks of its ring (``core.placement.ring.Ring``): one of its pieces on ``target``, its copy
    waited for by the compute stream, or ``None`` where the ring cannot serve it. Named here, so that the ring may
    lay out its members and a member know its ring without the modules importing each other."""

    def fetch(
        self, member: Member, target: Target, index: int = 0
    ) -> tuple[torch.Tensor | None, torch.Tensor | None] | None: ...


@dataclass(frozen=True)
class Piece:
    """What crosses for one computation of a layer: its group, and where its weight (the whole weight, or one row
    slice of it) and its bias (with the first piece only) lie in that group."""

    group: int
    weight: Part | None
    bias: Part | None


@dataclass(eq=False)
class Group:
    """A range of a slab that crosses in one copy: layers streamed whole, or one row slice of a layer (its bias
    with the first)."""

    slab: Slab
    start: int
    nbytes: int
    block: torch.Tensor  # the range, as a view of the slab's block
    modules: list[torch.nn.Module]  # the layers it carries, in order
    #: Each of its layers' tensors' parameter table, name and data pointer when packed: what a replaced weight
    #: changes, checked before each copy. The group's own, not its slab's: a slab kept from a larger budget holds
    #: several groups, and each copy would check them all.
    places: list[tuple[dict, str, int]] = field(default_factory=list)

    def note_places(self) -> None:
        """Record where each of the group's tensors is now (after packing, or after a replaced one came back)."""
        self.places = [
            (module._parameters, name, tensor.data_ptr())
            for module in self.modules
            for name, tensor in tensors_of(module)
        ]


@dataclass(eq=False)
class Member:
    """A streamed layer of a ring: its module, where its weight and bias lie in their slab, its pieces (one for a
    layer streamed whole, one per row slice for a layer streamed in slices), and their views in each slot."""

    ring: Fetcher
    module: torch.nn.Module
    weight: Part | None
    bias: Part | None
    pieces: list[Piece]
    views: list[list[tuple[torch.Tensor | None, torch.Tensor | None]]] = field(default_factory=list)
    #: The layer left the ring (its weight changed dtype or shape, or another loader moved it).
    left: bool = False
    #: ``fetch(target, index=0)``: this layer's piece ``index`` (its weight and bias, or one row slice of its weight
    #: with its bias for the first) on ``target``, their copy waited for by the compute stream; ``None`` when the
    #: ring cannot serve it (the caller copies the layer's tensors itself). The ring's own method bound to this
    #: layer, so that asking is one call (``core.devices.transfer.GroupedLayer``).
    fetch: Callable[..., tuple[torch.Tensor | None, torch.Tensor | None] | None] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.fetch = partial(self.ring.fetch, self)

    @property
    def group(self) -> int:
        """The group of its first piece."""
        return self.pieces[0].group


def slot_views(members: list[tuple[torch.nn.Module, Member]], buffers: list[torch.Tensor]) -> None:
    """Every member's pieces (weight and bias) as views of each ring slot in ``buffers``, where they lie in their
    group: right whenever the slot holds that group. Made each time the ring is allocated (each sampling call), for
    every streamed layer, so in one plain loop (``Part.view``'s work, done inline)."""
    for _module, member in members:
        views = []
        for buffer in buffers:
            pieces = []
            for piece in member.pieces:
                weight, bias = piece.weight, piece.bias
                if weight is not None:
                    weight = buffer.narrow(0, weight.offset, weight.nbytes).view(weight.dtype).view(weight.shape)
                if bias is not None:
                    bias = buffer.narrow(0, bias.offset, bias.nbytes).view(bias.dtype).view(bias.shape)
                pieces.append((weight, bias))
            views.append(pieces)
        member.views = views


@dataclass
class RingStats:
    """What the ring did: groups copied (``copies``), of which ahead of use (``ahead``) and through a staging
    buffer (``staged``), bytes copied, groups found in a slot already when reached (``hits``), times the groups
    were packed again in the order the model runs in (``reordered``), tensors whose place was checked before a
    copy (``checked``: the host work of finding a weight replaced since it was packed), and times its slots were
    allocated (``allocations``: once a sampling call, or a use of a model run once per use)."""

    copies: int = 0
    ahead: int = 0
    nbytes: int = 0
    hits: int = 0
    staged: int = 0
    reordered: int = 0
    checked: int = 0
    allocations: int = 0
