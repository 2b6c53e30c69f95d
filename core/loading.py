"""Partial loading: which layers of a model stay resident on its compute device and which stream from RAM,
moving between the two in place, under a budget, with an out-of-memory guard and LRU eviction.

It drives any module tree whose layers speak the cast protocol (``comfy_cast_weights``, ``weight_function``,
``bias_function``): ComfyUI's layers and ``core.ops``' alike. A *layer* is a module with tensors of its own.
A layer with the protocol can stream: its weights stay in host memory and its forward casts them to the
input's device for each use. Any other layer must be resident.

**Policy.** Which streamable layers stay resident when not all fit: ``largest-first`` (as ComfyUI does) keeps
the biggest layers, so the fewest bytes per layer stream and the room kept for casting the streamed ones is
smallest; ``execution-order`` keeps the first layers, so the copies of the later ones could overlap with the
computation of the earlier ones. ``tools/bench.py`` measures both (``--only policy``); the default is
:data:`DEFAULT_POLICY`, for the reason given there.

**Books.** Residency is not kept in a ledger beside the model: it is read from where each tensor is, so the
numbers cannot drift from the truth. (A simulated device keeps books of its own; tests check both agree.)

**Out of memory.** When a move runs out of device memory (another program took memory after the free
figure was read, fragmentation), the guard lowers the budget to what fitted minus one more layer, empties
the allocator's cache and tries once more; if that fails too, every layer that can stream streams. The
report says what happened, the lowered budget is remembered for later loads of the same model on that
device, and the model stays usable: every layer is either resident or streaming, never half-moved.

**Interruption.** A progress callback runs after each layer moved; when it raises (a user's cancel), the
layers moved so far stay resident, the others stream, and the exception goes on. Layers that cannot stream
move first, so an interrupted model still computes on its device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import torch

from .budget import ALL, Budget
from .errors import DeviceControlError
from .memory import capacity_bytes, empty_cache, free_bytes
from .placement import HOST, Target, is_on, label_of, move_own, own_tensors, tensor_bytes
from .simulated import SimulatedDevice, mark_streamed
from .transfer import pinned_memory
from .units import format_bytes

log = logging.getLogger("device_control")

ProgressCallback = Callable[[int, int], None]

#: While a streamed layer computes, its weights are on the device once in their stored dtype and once in the
#: compute dtype (twice the bytes when fp16 computes in fp32): room for that many copies of the largest
#: streamed layer is kept inside the budget.
STREAM_COPIES = 3


#: A module with this attribute set stays resident even when it could stream (a host application needs it on
#: the compute device: a text encoder reads its device from its token embedding, for instance).
RESIDENT_MARK = "device_control_resident"


class Policy(str, Enum):
    """Which streamable layers stay resident when a model does not fit its budget."""

    LARGEST_FIRST = "largest-first"
    EXECUTION_ORDER = "execution-order"


#: Largest-first streams the fewest bytes per streamed layer and needs the smallest casting room (see
#: ``tools/bench.py --only policy`` and README for the measurements behind this choice).
DEFAULT_POLICY = Policy.LARGEST_FIRST


@dataclass(frozen=True)
class Placement:
    """Where a model should live: its compute device, its budget there, and whether it may be evicted.

    ``device_id`` is the user's name for the device (``gpu:0``), for messages.
    """

    target: Target
    budget: Budget = ALL
    keep_resident: bool = False
    device_id: str = ""

    @property
    def name(self) -> str:
        """The device's name in messages: the user's, else the backend's."""
        return self.device_id or label_of(self.target)

    def budget_bytes(self) -> int:
        """The budget in bytes on this device now.

        Raises:
            InvalidSizeError: an absolute budget larger than the device.
        """
        return self.budget.resolve(capacity_bytes(self.target), device=self.name)


@dataclass(eq=False)
class Layer:
    """One module with tensors of its own: its size, and whether it can stream."""

    name: str
    module: torch.nn.Module
    nbytes: int
    streamable: bool

    def is_resident(self, target: Target | None) -> bool:
        """Whether all of this layer's tensors are on ``target``.

        Read from the tensors each time (a panel asks every second, so this loop stays plain).
        """
        if target is None:
            return False
        module = self.module
        for tensors in (module._parameters, module._buffers):
            for tensor in tensors.values():
                if tensor is not None and not is_on(tensor, target):
                    return False
        return True


def layers_of(root: torch.nn.Module) -> list[Layer]:
    """Every layer of ``root`` in registration order (for the models we drive, the order they run in).

    A layer marked with :data:`RESIDENT_MARK` does not stream. A tensor shared by two modules (tied weights)
    counts once, in the first. Buffers that are not saved with
    the model (non-persistent) count, as they take device memory too (ComfyUI's model sizes leave them out).
    """
    seen: set[int] = set()
    layers: list[Layer] = []
    for name, module in root.named_modules():
        nbytes = 0
        owns = False
        for _tensor_name, tensor, _is_param in own_tensors(module):
            owns = True
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            nbytes += tensor_bytes(tensor)
        if owns:
            streamable = hasattr(module, "comfy_cast_weights") and not getattr(module, RESIDENT_MARK, False)
            layers.append(Layer(name, module, nbytes, streamable))
    return layers


@dataclass(frozen=True)
class Plan:
    """Which layers are resident under a budget (the rest stream) and the bytes on each side."""

    budget: int
    policy: Policy
    resident: frozenset[str]
    resident_bytes: int
    streamed_bytes: int
    reserve_bytes: int
    fixed_bytes: int
    streamed_layers: int

    @property
    def over_budget(self) -> bool:
        """The layers that cannot stream (and the casting room) alone need more than the budget."""
        return self.resident_bytes + self.reserve_bytes > self.budget


def _greedy(order: Sequence[Layer], room: int) -> list[Layer]:
    chosen, used = [], 0
    for layer in order:
        if used + layer.nbytes <= room:
            chosen.append(layer)
            used += layer.nbytes
    return chosen


def _longest_prefix(candidates: Sequence[Layer], room: int, forced: int) -> list[Layer]:
    """The longest run of layers from the start that fits with the casting room the rest needs."""
    rest_max = [0] * (len(candidates) + 1)  # rest_max[i]: the largest layer from i on
    for i in range(len(candidates) - 1, -1, -1):
        rest_max[i] = max(rest_max[i + 1], candidates[i].nbytes)
    used, length = 0, 0
    for i, layer in enumerate(candidates):
        if used + layer.nbytes + STREAM_COPIES * max(rest_max[i + 1], forced) > room:
            break
        used += layer.nbytes
        length = i + 1
    if STREAM_COPIES * max(rest_max[length], forced) > room:
        return []
    return list(candidates[:length])


def plan_layers(
    layers: Sequence[Layer],
    budget: int,
    policy: Policy = DEFAULT_POLICY,
    *,
    allowed: Iterable[str] | None = None,
) -> Plan:
    """Choose the resident layers for ``budget`` bytes (weights plus casting room).

    The casting room is :data:`STREAM_COPIES` times the largest layer that streams. ``largest-first`` tries
    each possible largest streamed size: layers above it must be resident, the others are filled in from
    the largest down, and the choice that keeps the most bytes resident wins. ``execution-order`` keeps the
    longest run of layers from the start that fits with the room the rest needs to stream.

    Args:
        layers: the model's layers (:func:`layers_of`).
        budget: bytes the model may take on its device.
        policy: which streamable layers to prefer.
        allowed: when given, only these layers may be resident (an unload never moves other layers in).
    """
    fixed = [layer for layer in layers if not layer.streamable]
    streamable = [layer for layer in layers if layer.streamable]
    fixed_bytes = sum(layer.nbytes for layer in fixed)
    total = fixed_bytes + sum(layer.nbytes for layer in streamable)
    names = None if allowed is None else set(allowed)
    candidates = [layer for layer in streamable if names is None or layer.name in names]
    forced = max((layer.nbytes for layer in streamable if names is not None and layer.name not in names), default=0)
    chosen: list[Layer] = []
    if not forced and sum(layer.nbytes for layer in candidates) == total - fixed_bytes and total <= budget:
        chosen = candidates
    elif policy is Policy.EXECUTION_ORDER:
        chosen = _longest_prefix(candidates, budget - fixed_bytes, forced)
    else:
        candidates.sort(key=lambda layer: -layer.nbytes)
        best = -1
        for largest in sorted({layer.nbytes for layer in candidates} | {forced}, reverse=True):
            if largest < forced:
                break
            must = [layer for layer in candidates if layer.nbytes > largest]
            room = budget - fixed_bytes - STREAM_COPIES * largest - sum(layer.nbytes for layer in must)
            if room < 0:
                continue
            option = must + _greedy([layer for layer in candidates if layer.nbytes <= largest], room)
            kept = sum(layer.nbytes for layer in option)
            if kept > best:
                best, chosen = kept, option
    chosen_ids = {id(layer) for layer in chosen}
    streamed = [layer for layer in streamable if id(layer) not in chosen_ids]
    resident_bytes = fixed_bytes + sum(layer.nbytes for layer in chosen)
    resident_ids = {id(layer) for layer in fixed} | chosen_ids
    return Plan(
        budget=budget,
        policy=policy,
        resident=frozenset(layer.name for layer in layers if id(layer) in resident_ids),
        resident_bytes=resident_bytes,
        streamed_bytes=total - resident_bytes,
        reserve_bytes=STREAM_COPIES * max((layer.nbytes for layer in streamed), default=0),
        fixed_bytes=fixed_bytes,
        streamed_layers=len(streamed),
    )


class LayerHooks:
    """What a model's owner does when its layers change state; this default does nothing.

    ComfyUI's model patcher uses these to patch a layer's weights when it becomes resident, restore them
    when it leaves, and give streamed layers their on-the-fly patches.
    """

    def before_resident(self, layer: Layer, target: Target) -> None:
        """``layer`` stays on ``target`` or is about to move there (its cast flags are reset). Called for every
        resident layer at every load, so it must do nothing the second time (a weight patched already)."""

    def before_leaving(self, layer: Layer) -> None:
        """``layer`` is about to leave its device for host memory."""

    def on_streamed(self, layer: Layer) -> None:
        """``layer`` now streams (its cast flag is set, its weight and bias functions are empty)."""


NO_HOOKS = LayerHooks()


@dataclass
class LoadReport:
    """What a load did, for logs and node outputs."""

    target: str
    asked: int
    plan: Plan
    total_bytes: int
    resident_bytes: int
    moved_in: int = 0
    moved_out: int = 0
    oom: str | None = None

    @property
    def streamed_bytes(self) -> int:
        """Bytes that stay in host memory and stream."""
        return self.total_bytes - self.resident_bytes

    def summary(self) -> str:
        """``3.20 GiB: 1.20 GiB resident on sim:0, 2.00 GiB streamed (412 layers)``, plus what the guard did."""
        text = f"{format_bytes(self.total_bytes)}: {format_bytes(self.resident_bytes)} resident on {self.target}"
        if self.streamed_bytes:
            text += (
                f", {format_bytes(self.streamed_bytes)} streamed from {label_of(HOST)} "
                f"({self.plan.streamed_layers} layers)"
            )
        if self.plan.over_budget:
            text += (
                f"; the budget {format_bytes(self.plan.budget)} is below the {format_bytes(self.plan.fixed_bytes)} "
                "this model cannot stream, which stays resident anyway"
            )
        if self.oom:
            text += f"; {self.oom}"
        return text


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def same_target(a: Target | None, b: Target | None) -> bool:
    """Whether two targets are the same device (a simulated one by identity)."""
    if isinstance(a, SimulatedDevice) or isinstance(b, SimulatedDevice):
        return a is b
    return a is not None and b is not None and a == b


class PartialModel:
    """The loading engine for one module tree (keep one per tree: :func:`partial_model_of`).

    Args:
        root: the module tree.
    """

    def __init__(self, root: torch.nn.Module) -> None:
        self.root = root
        self.target: Target | None = None
        self.plan: Plan | None = None
        self.policy = DEFAULT_POLICY
        self.limits: dict[str, int] = {}
        self._layers: list[Layer] | None = None

    def layers(self) -> list[Layer]:
        """The tree's layers (computed once; :meth:`refresh` after the tree changes)."""
        if self._layers is None:
            self._layers = layers_of(self.root)
        return self._layers

    def refresh(self) -> None:
        """Forget the layer list (modules were added, removed or replaced)."""
        self._layers = None

    def total_bytes(self) -> int:
        """Bytes of all the model's tensors."""
        return sum(layer.nbytes for layer in self.layers())

    def resident_bytes(self, target: Target | None = None) -> int:
        """Bytes resident on ``target`` (default: the device the model was last loaded to)."""
        target = self.target if target is None else target
        if target is None:
            return 0
        return sum(layer.nbytes for layer in self.layers() if layer.is_resident(target))

    def streamed_layers(self) -> list[Layer]:
        """The layers that stream now."""
        return [layer for layer in self.layers() if layer.streamable and not layer.is_resident(self.target)]

    def describe(self, label: str, asked: int, *, oom: str | None = None) -> LoadReport:
        """The model as it is now, in the words of a load report (``label``: the user's name for the device).

        Raises:
            DeviceControlError: the engine holds no plan (nothing was loaded, or the tree was moved since).
        """
        if self.plan is None or self.target is None:
            raise DeviceControlError("the model is not loaded by Device Control now: no placement to describe.")
        resident = self.resident_bytes(self.target)
        return LoadReport(label, asked, self.plan, self.total_bytes(), resident, oom=oom)

    def holds(self, target: Target | None) -> bool:
        """Whether the tree is exactly as this engine's last load or unload left it, on ``target``.

        Every layer of the last plan is resident on ``target`` and not streaming; every other layer is in host
        memory and streams. Anything else means someone else moved the tree since (ComfyUI's own loader working
        on a clone that shares these weights, a cancelled move): a placement is then not in force, whatever
        the engine remembers. Read from the tensors, like every figure here.
        """
        plan = self.plan
        if plan is None or target is None or not same_target(self.target, target):
            return False
        for layer in self.layers():
            if layer.name in plan.resident:
                if not layer.is_resident(target) or _is_streaming(layer):
                    return False
            elif not (layer.is_resident(HOST) and _is_streaming(layer)):
                return False
        return True

    # -- loading -----------------------------------------------------------------------------------

    def load(
        self,
        target: Target,
        budget: int,
        *,
        policy: Policy | None = None,
        hooks: LayerHooks = NO_HOOKS,
        progress: ProgressCallback | None = None,
        fresh: bool = False,
    ) -> LoadReport:
        """Make the model resident on ``target`` as far as ``budget`` allows; the rest streams.

        Args:
            target: the compute device.
            budget: bytes the model may take there (weights plus casting room).
            policy: which layers to prefer (default: the last one used, initially :data:`DEFAULT_POLICY`).
            hooks: the owner's reactions to layer changes (patching).
            progress: called with ``(layers done, layers to do)`` after each layer; may raise to stop.
            fresh: forget a budget the out-of-memory guard lowered on an earlier load.

        Raises:
            DeviceControlError: not even the layers that cannot stream fit (the model is left in RAM).
        """
        self.policy = policy or self.policy
        key = label_of(target)
        if fresh:
            self.limits.pop(key, None)
        asked = budget
        budget = min(budget, self.limits.get(key, budget))
        layers = self.layers()
        before_in, before_out = self.resident_bytes(target), self._resident_elsewhere(target)
        plan = self._plan(target, budget)
        oom = None
        try:
            self._apply(plan, target, hooks, progress)
        except torch.OutOfMemoryError as error:
            resident = self.resident_bytes(target)
            biggest = max((la.nbytes for la in layers if la.streamable and la.is_resident(target)), default=0)
            lowered = max(0, resident - biggest)
            self.limits[key] = lowered
            empty_cache(target)
            oom = (
                f"out of memory on {key} with {format_bytes(resident)} resident ({_first_line(error)}); "
                f"budget lowered to {format_bytes(lowered)}"
            )
            log.warning("[Device Control] %s", oom)
            plan = self._plan(target, lowered)
            try:
                self._apply(plan, target, hooks, progress)
            except torch.OutOfMemoryError:
                oom += "; out of memory again, so every layer that can stream streams"
                self.limits[key] = 0
                empty_cache(target)
                plan = self._plan(target, 0)
                try:
                    self._apply(plan, target, hooks, progress)
                except torch.OutOfMemoryError as last:
                    fixed = plan.fixed_bytes
                    self.unload_all(hooks=hooks)
                    raise DeviceControlError(
                        f"{key} has no room even for the {format_bytes(fixed)} of this model that cannot stream "
                        f"({_first_line(last)}); the model stays in RAM. Free memory on {key} (Offload To CPU, "
                        "or close other programs using it), or choose another device."
                    ) from last
        resident = self.resident_bytes(target)
        return LoadReport(
            target=key,
            asked=asked,
            plan=plan,
            total_bytes=self.total_bytes(),
            resident_bytes=resident,
            moved_in=max(0, resident - before_in),
            moved_out=before_out + max(0, before_in - resident),
            oom=oom,
        )

    def unload(self, nbytes: int, *, hooks: LayerHooks = NO_HOOKS, progress: ProgressCallback | None = None) -> int:
        """Stream more layers, freeing at least ``nbytes`` on the device where possible; returns bytes freed."""
        target = self.target
        if target is None or nbytes <= 0:
            return 0
        before = self.resident_bytes(target)
        if nbytes >= before:
            return self.unload_all(hooks=hooks)
        streamed = self.streamed_layers()
        reserve = STREAM_COPIES * max((layer.nbytes for layer in streamed), default=0)
        allowed = [layer.name for layer in self.layers() if layer.is_resident(target)]
        plan = plan_layers(self.layers(), before + reserve - nbytes, self.policy, allowed=allowed)
        self._apply(plan, target, hooks, progress)
        return before - self.resident_bytes(target)

    def unload_all(self, *, hooks: LayerHooks = NO_HOOKS) -> int:
        """Move every layer to host memory and reset its cast flags (a model that computes on the host,
        or waits there to be loaded again); returns the bytes freed on the device."""
        target = self.target
        freed = 0
        for layer in self.layers():
            if target is not None and layer.is_resident(target):
                hooks.before_leaving(layer)  # patched weights are restored, on the host too
                if not same_target(target, HOST):
                    freed += layer.nbytes
            self._to_host(layer)
            _reset_flags(layer)
        self.target = None
        self.plan = None
        return freed

    # -- internals ---------------------------------------------------------------------------------

    def _plan(self, target: Target, budget: int) -> Plan:
        if not isinstance(target, SimulatedDevice) and target.type == "cpu":
            budget = self.total_bytes()  # on the host, everything is resident: there is nothing to stream from
        return plan_layers(self.layers(), budget, self.policy)

    def _resident_elsewhere(self, target: Target) -> int:
        if self.target is None or same_target(self.target, target) or same_target(self.target, HOST):
            return 0
        return self.resident_bytes(self.target)

    def _apply(self, plan: Plan, target: Target, hooks: LayerHooks, progress: ProgressCallback | None) -> None:
        layers = self.layers()
        self.plan = None  # until the plan is in place, the tree is in between
        old = self.target
        switching = old is not None and not same_target(old, target)
        for layer in layers:
            # A new device: everything leaves the old one first (patched weights restored, to be patched again
            # where they go). A layer on a third device (where another loader put it) leaves it too.
            stranded = not layer.is_resident(target) and not layer.is_resident(HOST)
            if stranded or (switching and layer.is_resident(old)):
                hooks.before_leaving(layer)
                self._to_host(layer)
        self.target = target
        outgoing = [la for la in layers if la.name not in plan.resident and la.is_resident(target)]
        incoming, staying = [], []
        for layer in layers:
            if layer.name in plan.resident:
                settled = layer.is_resident(target) and not _is_streaming(layer)
                (staying if settled else incoming).append(layer)
        incoming.sort(key=lambda layer: layer.streamable)  # those that cannot stream first (stable sort)
        total = len(outgoing) + len(incoming)
        done = 0
        try:
            for layer in outgoing:  # free room first
                hooks.before_leaving(layer)
                self._to_host(layer)
                self._stream(layer, hooks)
                done += 1
                if progress is not None:
                    progress(done, total)
            for layer in staying:  # resident already: the owner may still have to patch it (idempotent)
                hooks.before_resident(layer, target)
            for layer in incoming:
                self._make_resident(layer, target, hooks)
                done += 1
                if progress is not None:
                    progress(done, total)
        finally:
            for layer in layers:  # whatever happened, every layer is resident or streams
                if layer.streamable and not layer.is_resident(target):
                    self._stream(layer, hooks)
        self.plan = plan

    def _make_resident(self, layer: Layer, target: Target, hooks: LayerHooks) -> None:
        _reset_flags(layer)
        for _name, tensor, _is_param in own_tensors(layer.module):
            pinned_memory().unpin(tensor)
        try:
            hooks.before_resident(layer, target)
            for name, _tensor, _is_param in list(own_tensors(layer.module)):
                move_own(layer.module, name, target)
        except BaseException:
            hooks.before_leaving(layer)  # undo what the hooks did (a patched weight) before it streams again
            self._to_host(layer)
            if layer.streamable:
                self._stream(layer, hooks)
            raise

    @staticmethod
    def _to_host(layer: Layer) -> None:
        pinned = pinned_memory()
        for name, tensor, _is_param in list(own_tensors(layer.module)):
            pinned.unpin(tensor)  # before its memory can be freed or it moves to the device
            move_own(layer.module, name, HOST)

    def _stream(self, layer: Layer, hooks: LayerHooks) -> None:
        module = layer.module
        pin = isinstance(self.target, torch.device) and self.target.type == "cuda"
        for _name, tensor, is_param in own_tensors(module):
            if is_param:
                mark_streamed(tensor)
            if pin:  # copies from pinned memory run on the side stream without stopping the host
                pinned_memory().pin(tensor)
        if _is_streaming(layer):
            return  # streams already, with its functions in place
        module.prev_comfy_cast_weights = module.comfy_cast_weights
        module.comfy_cast_weights = True
        module.weight_function = []
        module.bias_function = []
        hooks.on_streamed(layer)


def _is_streaming(layer: Layer) -> bool:
    return hasattr(layer.module, "prev_comfy_cast_weights")  # ComfyUI's own mark of a streaming layer


def _reset_flags(layer: Layer) -> None:
    """Undo streaming marks: the cast flag the layer had before, no weight functions, weights not streamed."""
    module = layer.module
    if hasattr(module, "prev_comfy_cast_weights"):
        module.comfy_cast_weights = module.prev_comfy_cast_weights
        del module.prev_comfy_cast_weights
    if "weight_function" in module.__dict__:
        module.weight_function = []
    if "bias_function" in module.__dict__:
        module.bias_function = []
    for _name, tensor, is_param in own_tensors(module):
        if is_param:
            mark_streamed(tensor, False)


_ENGINE = "_device_control_engine"


def engine_of(root: torch.nn.Module) -> PartialModel | None:
    """The engine of ``root`` if it has been loaded by one (without creating one)."""
    return root.__dict__.get(_ENGINE)


def partial_model_of(root: torch.nn.Module) -> PartialModel:
    """The engine of ``root`` (created on first use and kept on the module, so every owner shares it)."""
    engine = root.__dict__.get(_ENGINE)
    if engine is None:
        engine = PartialModel(root)
        root.__dict__[_ENGINE] = engine
    return engine


# -- several models on one device ----------------------------------------------------------------------


class Managed(Protocol):
    """A model that can give device memory back (a registry entry, or ComfyUI's loaded-model entry)."""

    name: str
    keep_resident: bool

    def resident_on(self, target: Target) -> int:
        """Bytes it holds on ``target``."""

    def give_back(self, target: Target, nbytes: int | None) -> int:
        """Free ``nbytes`` on ``target`` (``None``: everything); return bytes freed."""


@dataclass
class Eviction:
    """What :func:`make_room` did."""

    needed: int
    freed: int = 0
    evicted: list[tuple[str, int]] = field(default_factory=list)
    short: int = 0

    def summary(self) -> str:
        """``made room: 2.00 GiB from SD15 diffusion model`` (empty when nothing was done)."""
        if not self.evicted and not self.short:
            return ""
        parts = [f"{format_bytes(freed)} from {name}" for name, freed in self.evicted]
        text = "made room: " + ", ".join(parts) if parts else ""
        if self.short:
            text += ("; " if text else "") + f"{format_bytes(self.short)} could not be freed"
        return text


def make_room(
    models: Sequence[Managed],
    target: Target,
    needed: int,
    *,
    free: Callable[[], int] | None = None,
    include_kept: bool = False,
) -> Eviction:
    """Free memory on ``target`` until ``needed`` bytes are free, least recently used models first.

    Args:
        models: the models that may give memory back, most recently used first (ComfyUI's own order).
        target: the device.
        needed: bytes that must be free.
        free: how to read what is free (default: :func:`core.memory.free_bytes`).
        include_kept: models marked keep-resident give memory back too (after all others) — only when the
            user asks for it.
    """
    free = free or (lambda: free_bytes(target))
    eviction = Eviction(needed)
    order = list(reversed(models))
    candidates = [m for m in order if not m.keep_resident]
    if include_kept:
        candidates += [m for m in order if m.keep_resident]
    for model in candidates:
        missing = needed - free()
        if missing <= 0:
            break
        held = model.resident_on(target)
        if held <= 0:
            continue
        freed = model.give_back(target, missing if missing < held else None)
        if freed > 0:
            eviction.freed += freed
            eviction.evicted.append((model.name, freed))
    eviction.short = max(0, needed - free())
    return eviction


@dataclass(eq=False)
class Registered:
    """A model in a :class:`Registry`."""

    name: str
    engine: PartialModel
    keep_resident: bool = False
    hooks: LayerHooks = NO_HOOKS

    def resident_on(self, target: Target) -> int:
        return self.engine.resident_bytes(target) if same_target(self.engine.target, target) else 0

    def give_back(self, target: Target, nbytes: int | None) -> int:
        if nbytes is None:
            return self.engine.unload_all(hooks=self.hooks)
        return self.engine.unload(nbytes, hooks=self.hooks)


class Registry:
    """The models managed on any device, most recently used first, for code that runs outside ComfyUI.

    (Inside ComfyUI its own ``current_loaded_models`` is the list, seen through the same :class:`Managed`
    interface, so there is one set of books.)
    """

    def __init__(self) -> None:
        self.entries: list[Registered] = []

    def add(self, name: str, root: torch.nn.Module, *, keep_resident: bool = False) -> Registered:
        """Manage ``root`` under ``name`` (again: update its flag)."""
        engine = partial_model_of(root)
        entry = next((e for e in self.entries if e.engine is engine), None)
        if entry is None:
            entry = Registered(name, engine, keep_resident)
            self.entries.insert(0, entry)
        entry.keep_resident = keep_resident
        return entry

    def load(
        self,
        entry: Registered,
        target: Target,
        budget: int,
        *,
        progress: ProgressCallback | None = None,
    ) -> tuple[LoadReport, Eviction]:
        """Load ``entry`` on ``target`` within ``budget``, first evicting others (LRU, keep-resident last and
        only never) as far as needed for what the plan wants resident."""
        self.entries.remove(entry)
        self.entries.insert(0, entry)
        plan = entry.engine._plan(target, budget)
        wanted = plan.resident_bytes + plan.reserve_bytes - entry.resident_on(target)
        others = [e for e in self.entries if e is not entry]
        eviction = make_room(others, target, wanted)
        return entry.engine.load(target, budget, hooks=entry.hooks, progress=progress), eviction

    def resident_on(self, target: Target) -> int:
        """Bytes all managed models hold on ``target``."""
        return sum(entry.resident_on(target) for entry in self.entries)
