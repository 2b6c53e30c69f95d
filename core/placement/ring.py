"""Grouped streaming: a model's streamed layers cross to the device a group at a time, into a fixed ring.

A real GPU copies a streamed weight at link speed; what made a streamed step slow there was the host: hundreds
of Python calls per layer to find, queue, check and wait for each tensor's copy. Here the work per layer is a
lookup, and everything else happens once per *group*:

* **Host slabs.** When a plan streams layers, their weights and biases are packed, in the order the model holds
  them, into groups of at most :attr:`Ring.group_bytes`, and each group into one block of host memory (a
  *slab*), page-locked once where the backend can (within the pinned-memory cap, ``core.devices.transfer``);
  each weight becomes a view of its slab, so host memory is not doubled. A slab whose group is unchanged is
  kept when the plan changes.
* **The ring.** :attr:`Ring.slots` device buffers of the largest group's size, allocated when the model first
  computes and given back when sampling ends (:meth:`Ring.settle`), so nothing beyond the plan's streaming
  reserve is held. Every streamed layer has a view of its weight and bias in each slot, made once.
* **One copy per group**, on the device's side stream, from slab to slot; an event marks its end, and the
  compute stream waits for it once, when the group's first layer computes. Before a slot is refilled, the copy
  waits for an event the compute stream recorded after the slot's last reader: no ``record_stream``, no
  allocation per copy, and device memory fixed by the ring.
* **Prefetch** is how many groups ahead are copied: the next group (learned from the order the model really
  runs in, wrapping from a pass's last group to the next pass's first for a model run step after step) crosses
  while this one computes. It changes when copies are issued, not how much host work they take, so it cannot
  make a step slower; ``DEVICE_CONTROL_PREFETCH=off`` leaves one slot, copied when reached.

The host never writes to or frees a slab a copy may still read: :meth:`Ring.settle` (end of sampling, and
before ComfyUI rewrites weights in place for its hooks) and :meth:`Ring.detach` wait for the copies in flight.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..devices.backends import Target, backend_of, label_of, same_target, target_of
from ..devices.memory import is_out_of_memory
from ..devices.tensors import HOST, count_copy
from ..devices.transfer import GROUPED
from .prefetch import prefetching
from .slabs import (
    Part,
    Slab,
    aligned,
    in_slab,
    in_slab_tensor,
    key_of,
    layer_bytes,
    pack,
    parts_of,
    tensors_of,
)

log = logging.getLogger("device_control")

#: Slots of the ring while prefetching: the group computing and the one crossing meanwhile.
PREFETCH_SLOTS = 2


@dataclass(eq=False)
class Member:
    """A streamed layer of a ring: its group, where its weight and bias lie, and their views in each slot."""

    ring: Ring
    group: int
    weight: Part | None
    bias: Part | None
    views: list[tuple[torch.Tensor | None, torch.Tensor | None]] = field(default_factory=list)

    def fetch(self, target: Target) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """This layer's weight and bias on ``target``, their copy waited for by the compute stream; ``None`` when
        the ring serves another device (the caller copies the layer's tensors as usual)."""
        return self.ring.fetch(self, target)


@dataclass
class RingStats:
    """What the ring did: groups copied (``copies``), of which ahead of use (``ahead``), bytes copied, and groups
    found in a slot already when reached (``hits``)."""

    copies: int = 0
    ahead: int = 0
    nbytes: int = 0
    hits: int = 0


class Ring:
    """The grouped streaming of one model's whole streamed layers to one device (one per model: the engine's)."""

    def __init__(self) -> None:
        #: Whether a pass's last group is followed by the next pass's first (a sampler's diffusion model); its
        #: owner turns it off for a model run once per use (a text encoder, a VAE).
        self.wraps = True
        self.stats = RingStats()
        self.target: Target | None = None
        self.group_bytes = 0
        self.slots = self._planned_slots = 0
        self._groups: list[Slab] = []
        self._members: list[tuple[torch.nn.Module, Member]] = []
        self._next: list[int | None] = []
        self._kept: dict[tuple[int, ...], Slab] = {}
        self._reset_ring()

    def _reset_ring(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._slot_bytes = 0
        self._holding: list[int | None] = []  # the group in each slot
        self._filled: list[object | None] = []  # the event that ends each slot's last fill
        self._waited: list[bool] = []  # whether the compute stream waited for that fill already
        self._slot_of: dict[int, int] = {}
        self._current: int | None = None
        self._released: object | None = None  # compute-stream event when the current group began
        self._closing = False  # the current group ends a pass of a model that does not wrap
        self._left = 0  # layers of that group still to compute

    # -- set up by the engine ---------------------------------------------------------------------

    def attach(self, modules: Sequence[torch.nn.Module], target: Target, reserve: int) -> None:
        """Stream ``modules`` (whole streamed layers in host memory, in the model's order) to ``target`` through a
        ring that fits in ``reserve`` bytes (the plan's streaming reserve)."""
        self.detach(unlock=False)
        if not modules:
            return
        sizes = [layer_bytes(module) for module in modules]
        self.slots = self._planned_slots = PREFETCH_SLOTS if prefetching() else 1
        self.group_bytes = max(max(sizes), reserve // (PREFETCH_SLOTS + 1))
        self.target = target
        groups, start, size = [], 0, 0
        for index, nbytes in enumerate(sizes):
            if size and size + nbytes > self.group_bytes:
                groups.append(modules[start:index])
                start, size = index, 0
            size += aligned(nbytes)
        groups.append(modules[start:])
        kept, self._kept = self._kept, {}
        for number, group in enumerate(groups):
            self._groups.append(self._slab_for(group, number, kept, target))
        self._next = [*range(1, len(groups)), None]

    def detach(self, *, unlock: bool = True) -> None:
        """Stop streaming through the ring (layers move, the model is unloaded, or another loader took it): the
        copies in flight are waited for and the ring freed. The slabs stay their weights' home and are kept for a
        next plan with the same groups; ``unlock``: they are unlocked too (the model leaves the device; a re-plan
        keeps them locked)."""
        self.settle()
        for module, _member in self._members:
            module.__dict__.pop(GROUPED, None)
        for group in self._groups:
            if unlock:
                group.unlock()
            self._kept[key_of(group.modules)] = group  # added to: attach detaches first too
        self._members, self._groups, self._next = [], [], []
        self.target = None

    def settle(self) -> None:
        """Sampling ended (or host weights are about to be rewritten): wait for the copies in flight, free the
        ring's device memory, and forget what its slots held. The groups and the learned order are kept."""
        if self._buffers and self.target is not None:
            backend = backend_of(self.target)
            for event in self._filled:
                backend.wait_host(event)
        for _module, member in self._members:
            member.views = []
        self._reset_ring()

    @property
    def ring_bytes(self) -> int:
        """Device bytes the ring holds now."""
        return len(self._buffers) * self._slot_bytes

    @property
    def host_bytes(self) -> tuple[int, int]:
        """Bytes of the slabs, (pinned, pageable)."""
        pinned = sum(group.nbytes for group in self._groups if group.pinned)
        return pinned, sum(group.nbytes for group in self._groups) - pinned

    # -- the hot path -------------------------------------------------------------------------------

    def fetch(self, member: Member, target: Target) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """``member``'s weight and bias on ``target`` (views of its group's slot), ready for the compute stream."""
        group = member.group
        if group != self._current:
            if group < 0 or not same_target(target, self.target) or not (self._buffers or self._allocate()):
                return None
            self._enter(group)
            if member.group < 0:  # its weight changed shape or dtype: it left the ring as its group was copied
                return None
        views = member.views[self._slot_of[group]]
        if self._closing:  # the last group of a model run once per use: the ring goes once it is used
            self._left -= 1
            if not self._left:
                self.settle()
        return views

    def _enter(self, group: int) -> None:
        """The first layer of ``group`` computes: its copy (and the next ones') queued, the compute stream made to
        wait for it. Once per group per pass: everything else a layer does is a lookup."""
        backend = backend_of(self.target)
        compute = backend.current_stream(self.target)
        if self._current is not None:
            self._learn(self._current, group)
        # Every read of the slots so far is before this event; so is all earlier work on memory a slot was
        # allocated from (a fresh ring's first fills wait for it too).
        self._released = backend.record(compute)
        self._current = group
        window = self._window(group)
        for ahead, wanted in enumerate(window):
            if wanted not in self._slot_of:
                self._fill(wanted, window, ahead=ahead > 0)
            elif not ahead:
                self.stats.hits += 1
        slot = self._slot_of[group]
        if not self._waited[slot]:
            backend.wait(compute, self._filled[slot])
            self._waited[slot] = True
        # A model run once per use (a text encoder, a VAE) is not sampled: nothing settles it, so its ring is given
        # back when its last group's layers have all computed, and nothing streamed stays on the device after it.
        self._closing = not self.wraps and self._next[group] is None
        self._left = len(self._groups[group].modules)

    def _window(self, group: int) -> list[int]:
        """``group`` and the groups expected after it, as many as the ring has slots."""
        window = [group]
        following = self._next[group]
        while following is not None and len(window) < self.slots and following not in window:
            window.append(following)
            following = self._next[following]
        return window

    def _learn(self, previous: int, group: int) -> None:
        """``group`` followed ``previous``: remember it, unless it starts a new pass of a model that does not
        wrap (then nothing follows a pass's last group)."""
        if self._next[previous] != group and (self.wraps or group > previous):
            self._next[previous] = group

    def _fill(self, group: int, window: list[int], *, ahead: bool) -> None:
        """Copy ``group``'s slab into a slot no group of ``window`` holds, on the side stream, after the compute
        stream's reads of that slot's old contents."""
        slot = next(i for i, held in enumerate(self._holding) if held is None or held not in window)
        previous = self._holding[slot]
        if previous is not None:
            del self._slot_of[previous]
        backend = backend_of(self.target)
        side = backend.side_stream(self.target)
        source = self._groups[group]
        self._refresh(group)
        if side is None:  # a backend without streams: a plain copy, in order with the computation
            backend.copy_into(self._buffers[slot].narrow(0, 0, source.nbytes), source.block, non_blocking=False)
            event = None
        else:
            with backend.on_stream(side):
                if self._released is not None:
                    backend.wait(side, self._released)
                destination = self._buffers[slot].narrow(0, 0, source.nbytes)
                backend.copy_into(destination, source.block, non_blocking=source.pinned)
                event = backend.record(side)
        self._holding[slot], self._filled[slot], self._waited[slot] = group, event, event is None
        self._slot_of[group] = slot
        count_copy(HOST, self.target, source.nbytes)  # the device's traffic books (memory profile, benchmarks)
        self.stats.copies += 1
        self.stats.ahead += ahead
        self.stats.nbytes += source.nbytes

    def _refresh(self, group: int) -> None:
        """Before ``group``'s slab is copied: a weight replaced by another tensor since it was packed (not written
        in place) is copied into the slab where it fits the same place, or leaves the ring (its layer then copies
        its tensors itself), as does one another loader moved to a device. A pointer compared per tensor and copy,
        not per use."""
        source = self._groups[group]
        if all(params[name].data_ptr() == pointer for params, name, pointer in source.places):
            return
        for module in source.modules:
            member = module.__dict__.get(GROUPED)
            for name, tensor in tensors_of(module):
                part = member.weight if name == "weight" else member.bias
                moved = not backend_of(target_of(tensor)).is_host  # another loader placed it: never pulled back
                if moved or part is None or (tensor.dtype, tensor.size()) != (part.dtype, part.shape):
                    module.__dict__.pop(GROUPED, None)
                    member.group = -1
                    break
                if not in_slab_tensor(tensor, source.block):
                    view = part.view(source.block)
                    view.copy_(tensor.data)
                    tensor.data = view
        source.note_places()

    def _allocate(self) -> bool:
        """The ring's slots on the device, and every member's views of its tensors in each. Where the device has
        no room for every slot (another program took memory since the plan was made), fewer slots; ``False``
        when not even one fits (the layers then copy their tensors one by one, as without a ring)."""
        backend = backend_of(self.target)
        size = self._slot_bytes = max(group.nbytes for group in self._groups)
        self._buffers = []
        try:
            for _ in range(self._planned_slots):
                self._buffers.append(backend.empty(self.target, torch.Size([size]), torch.uint8))
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            log.warning(
                "[Device Control] room for %d of %d streaming slots on %s; streaming with fewer",
                len(self._buffers),
                self._planned_slots,
                label_of(self.target),
            )
        if not self._buffers:
            return False
        self.slots = len(self._buffers)
        self._holding = [None] * self.slots
        self._filled = [None] * self.slots
        self._waited = [True] * self.slots
        for _module, member in self._members:
            member.views = [
                (
                    member.weight.view(buffer) if member.weight is not None else None,
                    member.bias.view(buffer) if member.bias is not None else None,
                )
                for buffer in self._buffers
            ]
        return True

    # -- host slabs -----------------------------------------------------------------------------------

    def _slab_for(
        self, modules: list[torch.nn.Module], number: int, kept: dict[tuple[int, ...], Slab], target: Target
    ) -> Slab:
        """``modules``' slab: the one kept from the last plan when it holds them as they are, else a new one they
        are packed into (each weight then a view of it)."""
        group = kept.get(key_of(modules))
        if group is None or not all(in_slab(module, group.block) for module in modules):
            group = pack(modules, target)
        else:
            group.lock(target)
        group.note_places()
        for module in modules:
            member = Member(self, number, *parts_of(module, group.block))
            module.__dict__[GROUPED] = member
            self._members.append((module, member))
        return group
