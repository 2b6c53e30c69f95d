"""Where each block of one model lives when an allocation shares it out over several devices.

**Blocks.** A model is split between whole blocks, never inside one: a *block* is an item of one of the model's
module lists (``double_blocks.3`` of a Flux model, ``input_blocks.4`` of a UNet), or an item of a sequence that is
made of modules made of modules (``middle_block.1``, a transformer), the outermost such item, so the lists inside
a block (its attention's ``transformer_blocks``) stay with it. The layers outside every block (a Flux model's
embeddings, a UNet's ``time_embed`` and ``label_emb`` sequences of single layers) go with the block that follows
them, and those after the last block with it. So a small layer never sits on another device than the block it
feeds, and the activations cross between devices only where one run of blocks ends and the next begins.

**Runs.** The devices of an allocation take the blocks in model order, one contiguous run each, in the order the
allocation names them. A size is a limit: the run ends before the block that would pass it. A share (and a
``*`` that is not last) is a target: the run ends at the block boundary nearest it, so the device holds its
share within half a block. The last device takes the rest, within its size if it has one. Devices may end up
with nothing (``cpu=*`` when the GPUs hold the whole model).

**Spread.** Where the first device computes every block and the others only store theirs (``stream``), a donor's
run in one piece at the end of the model would have its copies overlap only the compute of that run: the prefetch
copies a layer ahead when the layer before it computes, so the first device's run would compute with the link
idle. :func:`spread_split` keeps each device's bytes and deals its blocks out over the whole model instead, the
first block to the computing device (a pass's first streamed layer waits for its copy), each next one to the
device furthest behind its share at that point.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..devices.inventory import DeviceSpec
from ..errors import InvalidAllocationError
from ..units import format_bytes
from .allocation import Allocation, Entry
from .plan import Layer

#: Room kept on every device of a split beyond its part, for activations (as ComfyUI leaves some on its devices).
ACTIVATIONS = 256 * 1024**2


@dataclass(frozen=True)
class Block:
    """A run of layers placed together: ``name`` is its block's module path (where the block runs the model's
    layers outside any block too, they are in ``layers`` with it)."""

    name: str
    layers: tuple[Layer, ...]

    @property
    def nbytes(self) -> int:
        """The bytes of its layers' tensors."""
        return sum(layer.nbytes for layer in self.layers)


def blocks_of(root: torch.nn.Module, layers: Sequence[Layer]) -> list[Block]:
    """``layers`` (:func:`~core.placement.plan.layers_of` of ``root``, in model order) grouped into blocks."""
    items = {
        f"{name}.{child}" if name else child
        for name, module in root.named_modules()
        for child, item in module._modules.items()
        if _is_block(module, item)
    }
    blocks, pending = _group(layers, items)
    if pending and blocks:
        blocks[-1][1].extend(pending)
    elif pending:  # no list or sequence at all: one block per top-level module
        blocks = _by_top_module(pending)
    return [Block(name, tuple(group)) for name, group in blocks]


def _is_block(parent: torch.nn.Module, item: torch.nn.Module) -> bool:
    """Whether ``item``, a child of ``parent``, is a block: an item of a module list, or of a sequence when it is
    made of modules made of modules (a ResBlock, a transformer), not of single layers (linear-activation-linear)."""
    if isinstance(parent, torch.nn.ModuleList):
        return True
    return isinstance(parent, torch.nn.Sequential) and any(child._modules for child in item._modules.values())


def _group(layers: Sequence[Layer], items: set[str]) -> tuple[list[tuple[str, list[Layer]]], list[Layer]]:
    """The blocks of ``layers`` (each with the layers outside any block before it), and the layers after the
    last block."""
    blocks: list[tuple[str, list[Layer]]] = []
    pending: list[Layer] = []
    for layer in layers:
        name = _block_name(layer.name, items)
        if name is None:
            pending.append(layer)
        elif blocks and blocks[-1][0] == name:
            blocks[-1][1].append(layer)
        else:
            blocks.append((name, [*pending, layer]))
            pending = []
    return blocks, pending


def _block_name(layer: str, items: set[str]) -> str | None:
    parts = layer.split(".")
    for end in range(1, len(parts) + 1):
        prefix = ".".join(parts[:end])
        if prefix in items:
            return prefix
    return None


def _by_top_module(layers: Iterable[Layer]) -> list[tuple[str, list[Layer]]]:
    groups: list[tuple[str, list[Layer]]] = []
    for layer in layers:
        top = layer.name.split(".")[0]
        if groups and groups[-1][0] == top:
            groups[-1][1].append(layer)
        else:
            groups.append((top, [layer]))
    return groups


@dataclass(frozen=True)
class Part:
    """One device's run of blocks, and what the allocation let it hold."""

    device: DeviceSpec
    allowed: int
    blocks: tuple[Block, ...]
    spread: bool = False

    @property
    def nbytes(self) -> int:
        """The bytes of the blocks this device holds."""
        return sum(block.nbytes for block in self.blocks)

    def describe(self, total: int) -> str:
        """``gpu:0: 6.00 GiB (40.1 %), double_blocks.0 to single_blocks.3``."""
        share = f"{format_bytes(self.nbytes)} ({self.nbytes / total * 100:.1f} %)" if total else "0 B"
        if not self.blocks:
            return f"{self.device}: nothing"
        first, last = self.blocks[0].name, self.blocks[-1].name
        if self.spread and len(self.blocks) > 1:
            return f"{self.device}: {share}, {len(self.blocks)} blocks spread from {first} to {last}"
        return f"{self.device}: {share}, {first}" + (f" to {last}" if last != first else "")


@dataclass(frozen=True)
class Split:
    """Every device's part of one model, in model order."""

    parts: tuple[Part, ...]

    @property
    def total_bytes(self) -> int:
        """The model's bytes."""
        return sum(part.nbytes for part in self.parts)

    def device_of(self) -> dict[str, DeviceSpec]:
        """The device of every layer, by layer name."""
        return {layer.name: part.device for part in self.parts for block in part.blocks for layer in block.layers}

    def summary(self) -> str:
        """One line per device."""
        return "\n".join(part.describe(self.total_bytes) for part in self.parts)


def split_blocks(blocks: Sequence[Block], allocation: Allocation) -> Split:
    """Share ``blocks`` out over the devices of ``allocation`` (see the module's docstring).

    Raises:
        InvalidAllocationError: the allocation holds less than the model, or its sizes cannot hold the blocks
            placed whole; the message says how much is missing and where to give it.
    """
    capacities = _capacities(allocation, sum(block.nbytes for block in blocks))
    parts, start = [], 0
    for index, (entry, (device, allowed)) in enumerate(zip(allocation.entries, capacities, strict=True)):
        later = sum(size for _device, size in capacities[index + 1 :])
        end = len(blocks) if index == len(capacities) - 1 else _run_end(blocks, start, entry, allowed, later)
        run = tuple(blocks[start:end])
        if entry.size is not None and sum(block.nbytes for block in run) > allowed:
            raise InvalidAllocationError(_short_by_blocks(device, allowed, run))
        parts.append(Part(device, allowed, run))
        start = end
    return Split(tuple(parts))


def spread_split(split: Split) -> Split:
    """``split`` with each device's blocks dealt out over the whole model (see the module's docstring): every
    device holds about the bytes it held, never more than it may; ``split`` itself where one device holds
    everything, or where the blocks cannot be dealt within those limits."""
    shares = [part.nbytes for part in split.parts]
    if sum(1 for share in shares if share) < 2:
        return split
    blocks = [block for part in split.parts for block in part.blocks]
    dealt = _deal(blocks, shares, [max(part.allowed, part.nbytes) for part in split.parts])
    if dealt is None:
        return split
    parts = zip(split.parts, dealt, strict=True)
    return Split(tuple(Part(part.device, part.allowed, tuple(held), spread=True) for part, held in parts))


def _deal(blocks: Sequence[Block], shares: Sequence[int], limits: Sequence[int]) -> list[list[Block]] | None:
    """Each device's blocks, dealt in model order to the device furthest behind its share, within its limit and
    so that the blocks after still fit; ``None`` where no device can take a block."""
    room, held, done = list(limits), [0] * len(shares), 0
    dealt: list[list[Block]] = [[] for _share in shares]
    for index, block in enumerate(blocks):
        done += block.nbytes
        behind = _most_behind(shares, held, done, first=index == 0)
        where = next((i for i in behind if _rest_fits(blocks[index + 1 :], room, i, block.nbytes)), None)
        if where is None:
            return None
        room[where] -= block.nbytes
        held[where] += block.nbytes
        dealt[where].append(block)
    return dealt


def _most_behind(shares: Sequence[int], held: Sequence[int], done: int, *, first: bool) -> list[int]:
    """The devices that hold something, furthest behind their share of the ``done`` bytes first; for the first
    block, the computing device (the first) first."""
    total = sum(shares)
    devices = [i for i, share in enumerate(shares) if share]
    return sorted(devices, key=lambda i: (first and i != 0, held[i] - shares[i] * done / total, i))


def _rest_fits(rest: Sequence[Block], room: Sequence[int], where: int, size: int) -> bool:
    """Whether, with ``size`` bytes more on device ``where``, the blocks of ``rest`` still fit in the ``room`` left:
    filled in device order (as the runs were), or each to the device with the most room; a way found is a way
    that exists."""
    left = [free - (size if index == where else 0) for index, free in enumerate(room)]
    return left[where] >= 0 and (_packs(rest, left, in_order=True) or _packs(rest, left, in_order=False))


def _packs(blocks: Sequence[Block], room: Sequence[int], *, in_order: bool) -> bool:
    left, device = list(room), 0
    for block in blocks:
        if in_order:
            while device < len(left) and left[device] < block.nbytes:
                device += 1
        else:
            device = max(range(len(left)), key=left.__getitem__)
        if device == len(left) or left[device] < block.nbytes:
            return False
        left[device] -= block.nbytes
    return True


def _capacities(allocation: Allocation, total: int) -> list[tuple[DeviceSpec, int]]:
    """:meth:`Allocation.capacities`, refused when they hold less than the model."""
    capacities = allocation.capacities(total)
    held = sum(allowed for _device, allowed in capacities)
    if held < total and not _last_is_soft(allocation):
        raise InvalidAllocationError(
            f"allocation '{allocation}' holds {format_bytes(held)} of this model's {format_bytes(total)}: "
            f"{format_bytes(total - held)} short. Give a device more, add 'cpu=*' for the rest in RAM, or use 'auto'."
        )
    return capacities


def _last_is_soft(allocation: Allocation) -> bool:
    """Whether the last device takes whatever is left: a ``*``, or shares that add up to the whole model (their
    bytes, rounded down, may fall a few short)."""
    last = allocation.entries[-1]
    if last.takes_rest:
        return True
    return all(entry.share is not None for entry in allocation.entries) and (
        abs(sum(entry.share or 0.0 for entry in allocation.entries) - 1) < 1e-9
    )


def _run_end(blocks: Sequence[Block], start: int, entry: Entry, allowed: int, later: int) -> int:
    """Where the run of the device of ``entry`` ends (exclusive): before the block that passes its size, at the
    boundary nearest its share, or, for a ``*`` that is not last, where the devices after it can hold the rest."""
    used, end = 0, start
    if entry.takes_rest:
        left = sum(block.nbytes for block in blocks[start:])
        while end < len(blocks) and left > later:
            left -= blocks[end].nbytes
            end += 1
        return end
    while end < len(blocks):
        size = blocks[end].nbytes
        fits = used + size <= allowed if entry.size is not None else used + size / 2 <= allowed
        if not fits:
            break
        used += size
        end += 1
    return end


def _short_by_blocks(device: DeviceSpec, allowed: int, run: Sequence[Block]) -> str:
    held = sum(block.nbytes for block in run)
    return (
        f"placed in whole blocks, the last {len(run)} blocks of this model ({format_bytes(held)}) need "
        f"{format_bytes(held - allowed)} more than the {format_bytes(allowed)} {device} may hold. Give {device} at "
        f"least {format_bytes(held)}, or give an earlier device more, or end with 'cpu=*'."
    )


def auto_allocation(free: Mapping[DeviceSpec, int], reserve: int) -> Allocation:
    """``auto`` for devices with ``free`` bytes: the accelerators in order of free memory, most first, each up to
    its free memory less ``reserve`` (room for activations), then the CPU for the rest."""
    accelerators = sorted((spec for spec in free if spec.kind != "cpu"), key=lambda spec: -free[spec])
    entries = [Entry(spec, size=max(0, free[spec] - reserve)) for spec in accelerators]
    return Allocation((*entries, Entry(DeviceSpec("cpu"))))
