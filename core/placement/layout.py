"""How a ring lays its layers out: slabs of host memory (or of a donor device's), and the groups that cross.

Layers streamed whole are packed in the order given (the order the model runs in, once learned) into slabs of at
most the ring's group size, one group each. A layer streamed in row slices gets a slab of its own, bias first, and a
group per slice: the first holds the bias and the first rows, each next one the next rows, so every slice is one
range and one copy, and a slice of a large layer is a group of the ring like any other.

**Slabs are kept across plans.** A group whose layers lie, in its order and back to back, in a slab the last plan
made is that slab's range: nothing is copied. A smaller budget (smaller groups) then streams from the slabs it has;
only layers that come to stream, or groups that span two old slabs, are packed into new ones, and an old slab is
freed once nothing uses it (packing everything again at every budget held both in RAM at once, and the allocator
kept the old ones').
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ..devices.backends import Target, same_target, target_of
from ..devices.slices import SLICES
from ..devices.transfer import GROUPED
from .members import Fetcher, Group, Member, Piece
from .slabs import Part, Slab, aligned, bias_first, carried_bytes, in_slab_tensor, pack, parts_of, tensors_of

Members = list[tuple[torch.nn.Module, Member]]
#: The slabs the last plan left, by the id of each layer they hold.
Kept = dict[int, Slab]


def still_held(kept: Kept) -> Kept:
    """The kept slabs whose every layer still has its weight and bias in them; the others are let go (a conversion
    in place gives a layer new tensors, and its old slab would hold the old bytes in RAM beside the new ones until
    the next plan)."""
    held = {id(slab) for slab in kept.values() if _holds(slab)}
    let_go(slab for slab in kept.values() if id(slab) not in held)
    return {module: slab for module, slab in kept.items() if id(slab) in held}


def let_go(slabs: Iterable[Slab]) -> None:
    """Unlock each of ``slabs`` once (a slab is kept under the id of each layer it holds): it is freed once
    nothing else holds it."""
    for slab in {id(slab): slab for slab in slabs}.values():
        slab.unlock()


def repack_replaced(group: Group) -> None:
    """Before ``group`` is copied, a tensor of it replaced since it was packed: a weight replaced by another tensor
    (not written in place) is copied into the slab where it fits the same place, or leaves the ring (its layer then
    copies its tensors itself), as does one another loader moved to a device."""
    home = target_of(group.slab.block)
    for module in group.modules:
        member = module.__dict__.get(GROUPED)
        if member is None:  # it left the ring already (a layer in slices: at an earlier slice's group)
            continue
        for name, tensor in tensors_of(module):
            part = member.weight if name == "weight" else member.bias
            moved = not same_target(target_of(tensor), home)  # another loader moved it: never pulled back
            if moved or part is None or (tensor.dtype, tensor.size()) != (part.dtype, part.shape):
                module.__dict__.pop(GROUPED, None)
                member.left = True
                break
            if not in_slab_tensor(tensor, group.slab.block):
                view = part.view(group.slab.block)
                view.copy_(tensor.data)
                tensor.data = view
    group.note_places()


def _holds(slab: Slab) -> bool:
    """Whether every layer ``slab`` was packed for still has its tensors in it."""
    return all(in_slab_tensor(tensor, slab.block) for module in slab.modules for _name, tensor in tensors_of(module))


class _Layout:
    """What :func:`lay_out` builds: groups, the slabs they lie in (each once) and the members."""

    def __init__(self, ring: Fetcher, kept: Kept, target: Target) -> None:
        self.ring, self.kept, self.target = ring, kept, target
        self.groups: list[Group] = []
        self.slabs: dict[int, Slab] = {}
        self.members: Members = []

    def add(self, modules: list[torch.nn.Module], *, sliced: bool = False) -> None:
        """``modules``' group (layers streamed whole), or one layer streamed in slices and a group per slice, each
        layer marked with its member."""
        found = self._kept_range(modules, sliced)
        slab, start, nbytes = found if found is not None else self._packed(modules, sliced)
        if id(slab) not in self.slabs:
            self.slabs[id(slab)] = slab
            slab.modules = []  # the layers this plan streams from it
        slab.modules.extend(modules)
        if sliced:
            module = modules[0]
            weight, bias = parts_of(module, slab.block)
            ranges = module.__dict__[SLICES].ranges()
            pieces = [self._slice(slab, module, weight, None if i else bias, *rows) for i, rows in enumerate(ranges)]
            self._join(module, weight, bias, pieces)
            return
        number = len(self.groups)
        self.groups.append(Group(slab, start, nbytes, slab.block.narrow(0, start, nbytes), list(modules)))
        for module in modules:
            weight, bias = parts_of(module, slab.block)
            self._join(module, weight, bias, [Piece(number, _moved(weight, start), _moved(bias, start))])

    def _kept_range(self, modules: list[torch.nn.Module], sliced: bool) -> tuple[Slab, int, int] | None:
        """Where ``modules`` lie in order and back to back in one slab of the last plan (for a layer in slices:
        its own slab, bias first), as (slab, start, bytes); ``None`` when they do not."""
        slab = self.kept.get(id(modules[0]))
        if slab is None or (sliced and (len(slab.modules) != 1 or not bias_first(modules[0]))):
            return None
        found = _back_to_back(slab, [tensor for module in modules for _name, tensor in tensors_of(module)])
        if found is not None:
            slab.lock(self.target)
            return slab, *found
        return None

    def _packed(self, modules: list[torch.nn.Module], sliced: bool) -> tuple[Slab, int, int]:
        slab = pack(modules, self.target, bias_first=sliced)
        return slab, 0, slab.nbytes

    def _slice(
        self, slab: Slab, module: torch.nn.Module, weight: Part, bias: Part | None, start: int, stop: int
    ) -> Piece:
        """A group for rows ``start:stop`` of ``weight`` (and ``bias``, which lies just before the weight)."""
        row = weight.nbytes // weight.shape[0]
        first = weight.offset + start * row
        begin = first if bias is None else bias.offset
        nbytes = weight.offset + stop * row - begin
        number = len(self.groups)
        self.groups.append(Group(slab, begin, nbytes, slab.block.narrow(0, begin, nbytes), [module]))
        rows = Part(first - begin, (stop - start) * row, weight.dtype, torch.Size([stop - start, *weight.shape[1:]]))
        return Piece(number, rows, _moved(bias, begin))

    def _join(self, module: torch.nn.Module, weight: Part | None, bias: Part | None, pieces: list[Piece]) -> None:
        member = Member(self.ring, module, weight, bias, pieces)
        module.__dict__[GROUPED] = member
        self.members.append((module, member))


def _back_to_back(slab: Slab, tensors: list[torch.Tensor]) -> tuple[int, int] | None:
    """(start, bytes) of the range of ``slab`` that ``tensors`` fill in order, each right after the one before;
    ``None`` when they do not."""
    block = slab.block.data_ptr()
    offsets = [tensor.data_ptr() - block for tensor in tensors]
    sizes = [aligned(tensor.numel() * tensor.element_size(), slab.align) for tensor in tensors]
    if offsets[0] < 0 or offsets[-1] + sizes[-1] > slab.nbytes:
        return None
    if any(offsets[i] + sizes[i] != offsets[i + 1] for i in range(len(offsets) - 1)):
        return None
    return offsets[0], offsets[-1] + sizes[-1] - offsets[0]


def _moved(part: Part | None, start: int) -> Part | None:
    """``part`` (where a tensor lies in its slab) where it lies in a group starting at ``start`` of that slab."""
    return None if part is None else Part(part.offset - start, part.nbytes, part.dtype, part.shape)


def lay_out(
    ring: Fetcher, modules: Sequence[torch.nn.Module], group_bytes: int, kept: Kept, target: Target
) -> tuple[list[Group], list[Slab], Members]:
    """The groups, slabs and members of ``modules`` streamed to ``target`` through ``ring`` (each module marked with
    its member); the slabs of ``kept`` are streamed from where they hold a group's layers as they are."""
    layout = _Layout(ring, kept, target)
    batch, size = [], 0
    for module in modules:
        sliced, nbytes = SLICES in module.__dict__, carried_bytes(module)
        if batch and (sliced or size + nbytes > group_bytes):
            layout.add(batch)
            batch, size = [], 0
        if sliced:
            layout.add([module], sliced=True)
        else:
            batch.append(module)
            size += nbytes
    if batch:
        layout.add(batch)
    for group in layout.groups:
        group.note_places()
    return layout.groups, list(layout.slabs.values()), layout.members
