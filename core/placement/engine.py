"""The loading engine: a model's layers moved in place between its compute device and host memory, under a
budget, with an out-of-memory guard, for any module tree whose layers speak the cast protocol.

**Books.** Residency is not kept in a ledger beside the model: it is read from where each tensor is, so the
numbers cannot drift from the truth (a simulated device keeps books of its own; tests check both agree), and
:meth:`PartialModel.holds` tells whether the tree is still as the engine left it.

**Out of memory.** When a move runs out of device memory (another program took memory after the free
figure was read, fragmentation), the guard lowers the budget to what fitted minus one more layer, empties
the allocator's cache and tries once more; if that fails too, every layer that can stream streams. The
report says what happened, the lowered budget is remembered for later loads of the same model on that
device, and the model stays usable: every layer is either resident or streaming, never half-moved.

**Interruption.** A progress callback runs after each layer moved; when it raises (a user's cancel), the
layers moved so far stay resident, the others stream, and the exception goes on.
"""

from __future__ import annotations

import logging

import torch

from ..devices.backends import backend_of
from ..devices.memory import empty_cache, is_out_of_memory
from ..devices.pinned import pinned_memory
from ..devices.tensors import HOST, Target, label_of, same_target
from ..errors import DeviceControlError, first_line
from ..progress import ProgressCallback
from ..units import format_bytes
from .left import same_state, tree_state
from .load_report import LoadReport
from .plan import DEFAULT_POLICY, Layer, Plan, Policy, layers_of, plan_layers
from .ring import Ring
from .slabs import groupable
from .streaming import NO_HOOKS, LayerHooks, apply_plan, is_streaming, leave, reset_flags, to_host

log = logging.getLogger("device_control")


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
        self.ring = Ring(root)
        self._layers: list[Layer] | None = None
        #: All the tensors' bytes; how the last load or unload left the tree (:mod:`.left`); what its plan came from.
        self._total: int | None = None
        self._left, self._planned_for = None, None

    def layers(self) -> list[Layer]:
        """The tree's layers (computed once; :meth:`refresh` after the tree changes)."""
        if self._layers is None:
            self._layers = layers_of(self.root)
        return self._layers

    def refresh(self) -> None:
        """Forget the layer list (modules were added, removed or replaced, or their tensors rewritten), and the
        slabs kept for a next plan that the weights no longer lie in."""
        self._layers = self._total = self._left = None
        self.ring.forget_moved()

    def total_bytes(self) -> int:
        """Bytes of all the model's tensors (computed with the layer list)."""
        if self._total is None:
            self._total = sum(layer.nbytes for layer in self.layers())
        return self._total

    def resident_bytes(self, target: Target | None = None) -> int:
        """Bytes resident on ``target`` (default: the device the model was last loaded to)."""
        target = self.target if target is None else target
        if target is None:
            return 0
        if self._as_left(target):
            return self.plan.resident_bytes
        return sum(layer.nbytes for layer in self.layers() if layer.is_resident(target))

    def streamed_layers(self) -> list[Layer]:
        """The layers that stream now."""
        if self._as_left(self.target):
            resident = self.plan.resident
            return [layer for layer in self.layers() if layer.streamable and layer.name not in resident]
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
        if self._as_left(target):
            return True
        if not all(_as_planned(layer, layer.name in plan.resident, target) for layer in self.layers()):
            return False
        self._left = tree_state(self.layers())  # as planned, read in full: the next look is cheap again
        return True

    def _as_left(self, target: Target | None) -> bool:
        """Whether the tree is as the last load or unload left it on ``target``, nothing moved since (a cheap look,
        :mod:`.left`, that each sampling call can afford); when it says no, :meth:`holds` reads the tensors."""
        left = self._left
        if left is None or self.plan is None or target is None or not same_target(self.target, target):
            return False
        return same_state(left, tree_state(self.layers()))

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
        # The copy stream first: making a device's first stream takes driver memory of its own (tens of MiB on
        # CUDA), which must not be what a full device lacks in the middle of the first streamed step.
        backend_of(target).side_stream(target)
        pinned_memory().retry()
        if fresh:
            self.limits.pop(key, None)
        planned_for = self._plan_inputs(target, min(budget, self.limits.get(key, budget)), hooks)
        if planned_for == self._planned_for and self.holds(target):
            # Each sampling call loads again: the plan from these inputs is in force, resident layers patched.
            return LoadReport(key, budget, self.plan, self.total_bytes(), self.plan.resident_bytes)
        before_in, before_out = self.resident_bytes(target), self._resident_elsewhere(target)
        plan = self._plan(target, planned_for[1], hooks)
        plan, oom = self._apply_guarded(plan, target, hooks, progress)
        self._planned_for = planned_for if oom is None else None
        resident = self.resident_bytes(target)
        moved_in, moved_out = max(0, resident - before_in), before_out + max(0, before_in - resident)
        return LoadReport(key, budget, plan, self.total_bytes(), resident, moved_in, moved_out, oom)

    def unload(self, nbytes: int, *, hooks: LayerHooks = NO_HOOKS, progress: ProgressCallback | None = None) -> int:
        """Stream more layers, freeing at least ``nbytes`` on the device where possible; returns bytes freed."""
        target = self.target
        if target is None or nbytes <= 0:
            return 0
        before = self.resident_bytes(target)
        if nbytes >= before:
            return self.unload_all(hooks=hooks)
        # The same streaming unit as now: the layers streamed already keep their pieces, so the reserve can
        # only grow and the layers kept fit in what is left.
        reserve, unit = (self.plan.reserve_bytes, self.plan.unit) if self.plan is not None else (0, None)
        allowed = [layer.name for layer in self.layers() if layer.is_resident(target)]
        plan = plan_layers(
            self.layers(),
            before + reserve - nbytes,
            self.policy,
            allowed=allowed,
            multiples=self._multiples(hooks),
            unit=unit,
            extras=hooks.patch_bytes(),
        )
        self._apply(plan, target, hooks, progress)
        return before - self.resident_bytes(target)

    def unload_all(self, *, hooks: LayerHooks = NO_HOOKS) -> int:
        """Move every layer to host memory and reset its cast flags (a model that computes on the host,
        or waits there to be loaded again); returns the bytes freed on the device."""
        target = self.target
        freed = 0
        self._left = self._planned_for = None
        self.ring.detach()  # copies in flight waited for; slabs unlocked, kept as the weights' home
        for layer in self.layers():
            if target is not None and layer.is_resident(target):
                hooks.before_leaving(layer)  # patched weights are restored, on the host too
                freed += 0 if same_target(target, HOST) else layer.nbytes
            to_host(layer)
            reset_flags(layer)
        self.target = None
        self.plan = None
        return freed

    def release_streaming(self) -> None:
        """Another loader moved the tree since (ComfyUI's own, through a clone): stop streaming through the ring,
        giving its device memory back; every weight stays where that loader put it."""
        self._left = None
        self.ring.detach()

    # -- internals ---------------------------------------------------------------------------------

    def _plan_inputs(self, target: Target, budget: int, hooks: LayerHooks) -> tuple:
        """What a plan for ``target`` under ``budget`` is made from (device, budget, policy, the owner's answers)."""
        if backend_of(target).is_host:
            budget = self.total_bytes()  # on the host, everything is resident: there is nothing to stream from
        return label_of(target), budget, self.policy, self._multiples(hooks), hooks.patch_bytes()

    def _plan(self, target: Target, budget: int, hooks: LayerHooks) -> Plan:
        _label, budget, policy, multiples, extras = self._plan_inputs(target, budget, hooks)
        return plan_layers(self.layers(), budget, policy, multiples=multiples, extras=extras)

    def _multiples(self, hooks: LayerHooks) -> dict[str, int | None]:
        """The row multiple each layer that could stream in slices may be sliced on, as its owner says."""
        return {layer.name: hooks.slice_multiple(layer) for layer in self.layers() if layer.streamable and layer.rows}

    def _resident_elsewhere(self, target: Target) -> int:
        if self.target is None or same_target(self.target, target) or same_target(self.target, HOST):
            return 0
        return self.resident_bytes(self.target)

    def _apply(self, plan: Plan, target: Target, hooks: LayerHooks, progress: ProgressCallback | None) -> None:
        self.plan = self._left = self._planned_for = None  # until the plan is in place, the tree is in between
        self.ring.detach(unlock=False)  # slabs kept, locked, for groups that stay the same
        leave(self.layers(), self.target, target, hooks)
        self.target = target
        try:
            apply_plan(self.layers(), plan, target, hooks, progress)
        finally:  # whatever streams now streams through the ring, or prefetches, within the plan's reserve
            self._attach_streaming(plan, target)
        self.plan, self._left = plan, tree_state(self.layers())

    def _attach_streaming(self, plan: Plan, target: Target) -> None:
        """The layers that stream, whole or in row slices, go through the ring within the plan's reserve; a layer
        with a cast of its own copies its tensors itself."""
        if backend_of(target).is_host:
            self.ring.detach(unlock=False)
            return
        grouped = [layer.module for layer in self.streamed_layers() if groupable(layer.module)]
        self.ring.attach(grouped, target, plan.reserve_bytes - plan.ready_bytes)

    def _apply_guarded(
        self, plan: Plan, target: Target, hooks: LayerHooks, progress: ProgressCallback | None
    ) -> tuple[Plan, str | None]:
        """Apply ``plan``; out of memory (whichever torch class says it: :func:`is_out_of_memory`) lowers the
        budget once, then streams all that can stream. Any other error goes on unchanged."""
        try:
            self._apply(plan, target, hooks, progress)
            return plan, None
        except RuntimeError as error:
            if not is_out_of_memory(error):
                raise
            oom = self._lower_limit(target, error)
        try:
            return self._apply_lowered(target, hooks, progress, oom)
        finally:
            # The layers the lowered plan sent back to the host left their memory in torch's cache, where only
            # torch's allocator reuses it; what runs next outside it (a stream, a library's handle or workspace,
            # another program) is short of memory too, so the device gets it back.
            empty_cache(target)

    def _apply_lowered(
        self, target: Target, hooks: LayerHooks, progress: ProgressCallback | None, oom: str
    ) -> tuple[Plan, str]:
        """Apply the plan for the lowered budget; out of memory again streams all that can stream."""
        lowered = self._plan(target, self.limits[label_of(target)], hooks)
        try:
            self._apply(lowered, target, hooks, progress)
            return lowered, oom
        except RuntimeError as error:
            if not is_out_of_memory(error):
                raise
            oom += "; out of memory again, so every layer that can stream streams"
        return self._stream_all_that_can(target, hooks, progress), oom

    def _lower_limit(self, target: Target, error: BaseException) -> str:
        """Remember a budget one layer below what fitted on ``target``; say so."""
        key = label_of(target)
        resident = self.resident_bytes(target)
        biggest = max((la.nbytes for la in self.layers() if la.streamable and la.is_resident(target)), default=0)
        self.limits[key] = max(0, resident - biggest)
        empty_cache(target)
        oom = (
            f"out of memory on {key} with {format_bytes(resident)} resident ({first_line(error)}); "
            f"budget lowered to {format_bytes(self.limits[key])}"
        )
        log.warning("[Device Control] %s", oom)
        return oom

    def _stream_all_that_can(self, target: Target, hooks: LayerHooks, progress: ProgressCallback | None) -> Plan:
        key = label_of(target)
        self.limits[key] = 0
        empty_cache(target)
        plan = self._plan(target, 0, hooks)
        try:
            self._apply(plan, target, hooks, progress)
        except RuntimeError as last:
            if not is_out_of_memory(last):
                raise
            self.unload_all(hooks=hooks)
            raise DeviceControlError(
                f"{key} has no room even for the {format_bytes(plan.fixed_bytes)} of this model that cannot stream "
                f"({first_line(last)}); the model stays in RAM. Free memory on {key} (Offload To CPU, or close "
                "other programs using it), or choose another device."
            ) from last
        return plan


def _as_planned(layer: Layer, resident: bool, target: Target) -> bool:
    """A planned-resident layer is on ``target`` and not streaming; any other one is on the host, streaming."""
    if resident:
        return layer.is_resident(target) and not is_streaming(layer)
    return layer.is_resident(HOST) and is_streaming(layer)


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
