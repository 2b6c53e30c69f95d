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
* **Groups follow the order the model runs in**, not the order it registers its layers (a transformer block
  registers attn1, ff, attn2, norms and runs norm1, attn1, norm2, attn2, norm3, ff): the first pass through a ring
  is watched layer by layer, and when it ends (a layer comes again, or the model's use ends) the groups are packed
  again in that order, once, so each group crosses once a pass. The order learned is kept for later plans.
* **Prefetch** is how many groups ahead are copied: the next group (learned from the order the model really
  runs in, wrapping from a pass's last group to the next pass's first for a model run step after step) crosses
  while this one computes. It changes when copies are issued, not how much host work they take, so it cannot
  make a step slower; ``DEVICE_CONTROL_PREFETCH=off`` leaves one slot, copied when reached.
* **The end of a use.** A model run once per use (a text encoder, a VAE: :attr:`Ring.wraps` off) gives its ring
  back when its use ends, read from the model's own forwards (``core.placement.uses``), whatever order its layers
  run in and whichever of them it uses.
* **No room for the ring** (another program took memory since the plan was made): the layers copy their tensors
  one by one until the next :meth:`Ring.settle`; the allocation is not tried again at every layer.
* **A slab that could not be page-locked** crosses through the ring's page-locked staging buffers, a pool apart
  from the slots (``core.placement.staging``), so the host does not wait for the device at every group.

The host never writes to or frees a slab a copy may still read: :meth:`Ring.settle` (end of sampling),
:meth:`Ring.forget_slots` (before ComfyUI rewrites weights in place for its hooks, keeping the slots) and
:meth:`Ring.detach` wait for the copies in flight.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ..devices.backends import Target, backend_of, label_of, same_target, target_of
from ..devices.memory import is_out_of_memory
from ..devices.tensors import Route
from ..devices.transfer import GROUPED
from .layout import Kept, lay_out, let_go, repack_replaced, still_held
from .members import Group, Member, RingStats, slot_views
from .prefetch import PREFETCH_SLOTS, prefetching
from .rings import register, unregister
from .run_order import RunOrder, Successors
from .slabs import Slab, piece_bytes
from .staging import Staging, pool_size
from .uses import UseWatch

log = logging.getLogger("device_control")


class Ring:
    """The grouped streaming of one model's whole streamed layers to one device (one per model: the engine's).

    Args:
        root: the model, watched for the end of each use when it does not :attr:`wraps`.
    """

    def __init__(self, root: torch.nn.Module | None = None) -> None:
        self.root = root  # the ring registers with it while it streams layers (``core.placement.rings``)
        self._wraps = True
        self.stats = RingStats()
        self.target: Target | None = None
        self.group_bytes = 0
        self.slots = self._planned_slots = 0
        self._reserve = 0
        self._groups: list[Group] = []
        self._slabs: list[Slab] = []
        self._members: list[tuple[torch.nn.Module, Member]] = []
        self._kept: Kept = {}
        self._order = RunOrder()
        self._staging = Staging()
        self._uses = UseWatch(self._end_of_use)
        self._after = Successors()  # what follows each group: its prefetch window
        self._routes: dict[int, Route] = {}  # the traffic books of each slab's copies, by the slab's id
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
        self._failed = False  # no slot fitted: the layers copy their own tensors until the next settle
        self._own_copies = False  # a layer copied its own tensors from a slab (not waited for by the fills)

    @property
    def wraps(self) -> bool:
        """Whether a pass's last group is followed by the next pass's first (a sampler's diffusion model: the
        next step's first group is copied while the last one computes); its owner turns it off for a model run
        once per use (a text encoder, a VAE)."""
        return self._wraps

    @wraps.setter
    def wraps(self, wraps: bool) -> None:
        self._wraps = wraps
        self._after.wrap(wraps)

    # -- set up by the engine ---------------------------------------------------------------------

    def attach(self, modules: Sequence[torch.nn.Module], target: Target, reserve: int) -> None:
        """Stream ``modules`` (streamed layers, whole or in row slices, in host memory or on a donor device, in the
        model's order) to ``target`` through a ring whose slots fit in ``reserve`` bytes (the part of the plan's
        streaming reserve for copies: the rest is for the piece computing once made ready), grouped in the order
        the model runs in where it is known."""
        self.detach(unlock=False)
        if not modules:  # nothing streams: no slab is kept, or kept page-locked, for a plan that may not come
            let_go(self._kept.values())
            self._kept = {}
            return
        self._build(self._order.sort(modules), target, reserve)
        if self.root is not None:
            self._uses.watch(self.root)
            register(self.root, self)

    def _build(self, modules: Sequence[torch.nn.Module], target: Target, reserve: int) -> None:
        """Groups of whole layers of at most :attr:`group_bytes` each, in ``modules``' order, and a group per row
        slice of a layer streamed in slices."""
        self.slots = self._planned_slots = PREFETCH_SLOTS if prefetching() else 1
        self.group_bytes = max(max(piece_bytes(module) for module in modules), reserve // PREFETCH_SLOTS)
        self.target, self._reserve, self._backend = target, reserve, backend_of(target)
        kept, self._kept = self._kept, {}
        self._groups, self._slabs, self._members = lay_out(self, modules, self.group_bytes, kept, target)
        self._after.reset(len(self._groups), self._wraps)
        self._group_max = max(group.nbytes for group in self._groups)
        self._routes = {}  # kept across sampling calls, for this plan's slabs

    def detach(self, *, unlock: bool = True) -> None:
        """Stop streaming through the ring (layers move, the model is unloaded, or another loader took it): the
        copies in flight are waited for and the ring freed. The slabs stay their weights' home and are kept for a
        next plan with the same groups; ``unlock``: they are unlocked too (the model leaves the device; a re-plan
        keeps them locked), as are the staging buffers."""
        self.settle()
        self._uses.unwatch()
        if self.root is not None:  # a model with nothing streamed has no ring to settle or refill: no call a step
            unregister(self.root, self)
        for module, _member in self._members:
            module.__dict__.pop(GROUPED, None)
        for slab in self._slabs:
            if unlock:
                slab.unlock()
            if backend_of(target_of(slab.block)).is_host:  # a donor's slab is its device memory: never kept
                self._kept.update((id(module), slab) for module in slab.modules)
        if unlock:
            self._staging.release()
        self._members, self._groups, self._slabs = [], [], []
        self._order.stop()
        self.target = None

    def forget_moved(self) -> None:
        """The model's layers changed (their tensors rewritten in place): let go of the kept slabs they left."""
        self._kept = still_held(self._kept)

    def settle(self) -> None:
        """Sampling ended (or the ring is detached): wait for the copies in flight, free the ring's device memory,
        and forget what its slots held. The groups and the learned order are kept; a ring that found no room may
        try again."""
        self._wait_for_copies()
        for _module, member in self._members:
            member.views = []
        self._reset_ring()

    def forget_slots(self) -> None:
        """The host weights are about to be rewritten in place (ComfyUI's hooks, between two calls of one step):
        wait for the copies that read them and forget what the slots hold, so that each group crosses again as it
        is then. The slots, and every layer's views of them, are kept for the next call (settling freed them and
        made every view again, twice a step)."""
        self._wait_for_copies()
        slots = len(self._buffers)
        self._holding, self._filled, self._waited = [None] * slots, [None] * slots, [True] * slots
        self._slot_of, self._current, self._own_copies = {}, None, False

    def _wait_for_copies(self) -> None:
        """The host waits for every copy that may still read host memory: the slots' fills, and the copies layers
        made of their own tensors on the compute stream."""
        if self.target is None:
            return
        backend = backend_of(self.target)
        for event in self._filled:
            backend.wait_host(event)
        if self._own_copies:
            backend.wait_host(backend.record(backend.current_stream(self.target)))

    @property
    def groups(self) -> int:
        """How many groups the ring streams: a pass's copies, once the order the model runs in is learned."""
        return len(self._groups)

    @property
    def ring_bytes(self) -> int:
        """Device bytes the ring holds now."""
        return len(self._buffers) * self._slot_bytes

    @property
    def host_bytes(self) -> tuple[int, int]:
        """Bytes of the slabs, (pinned, pageable)."""
        pinned = sum(slab.nbytes for slab in self._slabs if slab.pinned)
        return pinned, sum(slab.nbytes for slab in self._slabs) - pinned

    # -- the hot path -------------------------------------------------------------------------------

    def fetch(
        self, member: Member, target: Target, index: int = 0
    ) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """``member``'s piece ``index`` (its weight, or one row slice of it, and its bias with the first) on
        ``target``, as views of its group's slot, ready for the compute stream; ``None`` when the ring cannot serve
        it (the caller copies the layer's tensors itself)."""
        if not index and self._order.learning and self._order.note(member.module) and self._relearn():
            member = member.module.__dict__.get(GROUPED)  # packed again: the layer's new place
            if member is None:
                return None
        group = member.pieces[index].group
        # Not served (it left the ring, maybe as its group was copied; no room): it copies its own, settle waits.
        if member.left or (group != self._current and not self._enter(group, target)) or member.left:
            self._own_copies = True
            return None
        return member.views[self._slot_of[group]][index]

    def _enter(self, group: int, target: Target) -> bool:
        """The first layer of ``group`` computes: its copy (and the next ones') queued, the compute stream made to
        wait for it; ``False`` where the ring cannot serve it (another device, a layer that left the ring, no room
        for a slot). Once per group per pass, in one call with what follows it (the host work of a streamed layer
        is counted in calls: ``tools/bench/host.py``): everything else a layer does is a lookup."""
        if group < 0 or self._failed or (target is not self.target and not same_target(target, self.target)):
            return False
        if not self._buffers and not self._allocate():
            self._failed = True
            return False
        backend = self._backend
        compute = backend.current_stream(self.target)
        # Every read of the slots so far is before this event; so is all earlier work on memory a slot was
        # allocated from (a fresh ring's first fills wait for it too).
        self._released = backend.record(compute)
        window = self._after.enter(self._current, group, self.slots)
        self._current = group
        self.stats.hits += group in self._slot_of
        for ahead, wanted in enumerate(window):
            if wanted not in self._slot_of:
                self._fill(wanted, window, ahead=ahead > 0)
        slot = self._slot_of[group]
        if not self._waited[slot]:
            backend.wait(compute, self._filled[slot])
            self._waited[slot] = True
        return True

    def _end_of_use(self) -> None:
        """The model's computation ended (``core.placement.uses``): a model run once per use gives its ring back
        (nothing settles it otherwise), the order of its first pass learned, or that nothing follows its last group
        (a VAE's decode leaves its encoder's groups out: none is copied ahead for it)."""
        if self.wraps:
            return
        if self._order.learning and self._order.watched:
            self._relearn()
        elif self._current is not None:
            self._after.followed(self._current, None)
        self.settle()

    def _relearn(self) -> bool:
        """The first pass ended: pack the groups again in the order it ran in, if it is not theirs (``True``)."""
        packed = {id(module): module for group in self._groups for module in group.modules}  # a sliced one once
        order = self._order.learn(list(packed.values()))
        if order is not None:
            self._repack(order)
        return order is not None

    def _repack(self, order: list[torch.nn.Module]) -> None:
        """Pack the groups again in ``order``: the copies in flight waited for, the old slabs unlocked and let go
        (each is freed as its last weight moves to a new one, so host memory grows by a group at most)."""
        self.settle()
        for module, member in self._members:
            module.__dict__.pop(GROUPED, None)
            member.left = True  # a layer computing in slices now holds it: its next slices copy themselves
        for slab in self._slabs:
            slab.unlock()
        self._members, self._groups, self._slabs, self._kept = [], [], [], {}
        self._build(order, self.target, self._reserve)
        self.stats.reordered += 1

    def _fill(self, group: int, window: list[int], *, ahead: bool) -> None:
        """Copy ``group``'s slab into a slot no group of ``window`` holds, on the side stream, after the compute
        stream's reads of that slot's old contents."""
        slot = 0
        while self._holding[slot] is not None and self._holding[slot] in window:  # a slot the window does not need
            slot += 1
        previous = self._holding[slot]
        if previous is not None:
            del self._slot_of[previous]
        backend = self._backend
        side = backend.side_stream(self.target)
        source = self._groups[group]
        for params, name, pointer in source.places:  # a pointer compared per tensor and copy, not per use
            self.stats.checked += 1
            if params[name].data_ptr() != pointer:
                repack_replaced(source)
                break
        if side is None:  # a backend without streams: a plain copy, in order with the computation
            backend.copy_into(self._buffers[slot].narrow(0, 0, source.nbytes), source.block, non_blocking=False)
            event = None
        else:
            event = self._copy(slot, source, side)
        self._holding[slot], self._filled[slot], self._waited[slot] = group, event, event is None
        self._slot_of[group] = slot
        books = self._routes.get(id(source.slab)) or self._route(source.slab)
        books.add(source.nbytes)  # the traffic books (profile, benchmarks)
        self.stats.copies += 1
        self.stats.ahead += ahead
        self.stats.nbytes += source.nbytes

    def _copy(self, slot: int, source: Group, side: object) -> object:
        """``source`` copied into ``slot`` on the side stream once the compute stream's earlier reads are done
        (even taking a view of the slot is work on a stream), through a staging buffer where the slab is pageable;
        the event that ends the copy."""
        backend = self._backend
        staged = not source.slab.pinned and self._staging.ready
        data = self._staging.stage(source.block) if staged else source.block
        with backend.on_stream(side):
            if self._released is not None:
                backend.wait(side, self._released)
            destination = self._buffers[slot].narrow(0, 0, source.nbytes)
            backend.copy_into(destination, data, non_blocking=source.slab.pinned or staged)
            event = backend.record(side)
        if staged:
            self._staging.used(event)
            self.stats.staged += 1
        return event

    def _route(self, slab: Slab) -> Route:
        """The traffic books of ``slab``'s copies into the ring, found once."""
        self._routes[id(slab)] = Route(target_of(slab.block), self.target)
        return self._routes[id(slab)]

    def _allocate(self) -> bool:
        """The ring's slots on the device, and every member's views of its tensors in each. Where the device has
        no room for every slot (another program took memory since the plan was made), fewer slots; ``False``
        when not even one fits (the layers then copy their tensors one by one, as without a ring)."""
        size = self._slot_bytes = self._group_max
        self._buffers = self._slots(size)
        if not self._buffers:
            return False
        self.stats.allocations += 1
        if [slab for slab in self._slabs if not slab.pinned]:
            self._staging.prepare(self.target, pool_size(len(self._buffers), len(self._groups), size), size)
        if self.slots != len(self._buffers):  # fewer slots than the windows were made for
            self._after.new_slots()
        self.slots = len(self._buffers)
        self._holding = [None] * self.slots
        self._filled = [None] * self.slots
        self._waited = [True] * self.slots
        slot_views(self._members, self._buffers)
        return True

    def _slots(self, size: int) -> list[torch.Tensor]:
        """As many of the planned slots of ``size`` bytes as the device has room for, said once when fewer."""
        backend, buffers = backend_of(self.target), []
        try:
            for _ in range(self._planned_slots):  # plain tensors, filled in place whether or not in inference mode
                with torch.inference_mode(False):
                    buffers.append(backend.empty(self.target, torch.Size([size]), torch.uint8))
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            log.warning(
                "[Device Control] room for %d of %d streaming slots on %s; %s until sampling ends",
                len(buffers),
                self._planned_slots,
                label_of(self.target),
                "streaming with fewer" if buffers else "each streamed layer copies its own weights",
            )
        return buffers
