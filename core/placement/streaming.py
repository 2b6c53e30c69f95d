"""A layer's two states, resident on its compute device or streaming from host memory, and the moves between.

The moves keep ComfyUI's layer protocol: a streaming layer has ``comfy_cast_weights`` set, the flag it had
before in ``prev_comfy_cast_weights`` (ComfyUI's own mark of a streaming layer), and empty ``weight_function``
and ``bias_function`` lists for its owner's on-the-fly patches. A layer the plan streams in row slices also
carries its slices (``core.devices.slices.SLICES``). The owner reacts to each change through
:class:`LayerHooks` (patching a weight that becomes resident, restoring it when it leaves) and says which
layers its patches let stream in slices.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..devices.marks import mark_streamed
from ..devices.pinned import pinned_memory
from ..devices.slices import ROW_QUANTUM, SLICES, RowSlices
from ..devices.tensors import HOST, Target, move_own, own_tensors, same_target
from ..progress import ProgressCallback
from .plan import Layer, Plan
from .slabs import groupable


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

    def patch_bytes(self) -> dict[str, int]:
        """By layer name, the bytes a layer keeps on its device beside its weights while it streams (the factors
        of its on-the-fly patches, ``core.weights.patch_factors``): the plan keeps room for them."""
        return {}

    def slice_multiple(self, layer: Layer) -> int | None:
        """The multiple of rows a slice of ``layer``'s weight must hold for the owner's on-the-fly patches to
        apply to it alone; ``None`` when they need the whole weight (the layer then streams whole)."""
        return ROW_QUANTUM


NO_HOOKS = LayerHooks()
#: ComfyUI's mark of a layer that casts its weights on each use: the ``comfy_cast_weights`` it had before.
STREAMING_MARK = "prev_comfy_cast_weights"


def is_streaming(layer: Layer) -> bool:
    """Whether ``layer`` is marked to cast its weights on each use."""
    return hasattr(layer.module, STREAMING_MARK)


def to_host(layer: Layer) -> None:
    """Move every tensor of ``layer`` to host memory (unpinned first, so its memory can be freed)."""
    pinned = pinned_memory()
    for name, tensor, _is_param in list(own_tensors(layer.module)):
        pinned.unlock(tensor)
        move_own(layer.module, name, HOST)


def stream(layer: Layer, target: Target | None, hooks: LayerHooks, slices: RowSlices | None = None) -> None:
    """Mark ``layer`` (in host memory) to be cast to ``target`` on each use, whole or in ``slices``; the owner then
    adds its patches."""
    module = layer.module
    if slices is None:
        module.__dict__.pop(SLICES, None)
    else:
        module.__dict__[SLICES] = slices
    # A copy from pinned memory does not stop the host. A layer its model's ring will carry (whole or in row
    # slices) is packed into a page-locked slab instead (``core.placement.ring``): pinning it in place first would
    # leave a registration on memory the packing frees, and every later registration on those pages would fail.
    pin = target is not None and not groupable(module)
    for _name, tensor, is_param in own_tensors(module):
        if is_param:
            mark_streamed(tensor)
        if pin:
            pinned_memory().lock(tensor, target)
    if is_streaming(layer):
        return  # streams already, with its functions in place
    module.prev_comfy_cast_weights = module.comfy_cast_weights
    module.comfy_cast_weights = True
    module.weight_function = []
    module.bias_function = []
    hooks.on_streamed(layer)


def reset_flags(layer: Layer) -> None:
    """Undo streaming marks: the cast flag the layer had before, no weight functions, weights not streamed."""
    module = layer.module
    module.__dict__.pop(SLICES, None)
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


def make_resident(layer: Layer, target: Target, hooks: LayerHooks) -> None:
    """Move ``layer`` onto ``target``; on any failure it goes back to streaming, its patches undone."""
    reset_flags(layer)
    for _name, tensor, _is_param in own_tensors(layer.module):
        pinned_memory().unlock(tensor)
    try:
        hooks.before_resident(layer, target)
        for name, _tensor, _is_param in list(own_tensors(layer.module)):
            move_own(layer.module, name, target)
    except BaseException:
        hooks.before_leaving(layer)  # undo what the hooks did (a patched weight) before it streams again
        to_host(layer)
        if layer.streamable:
            stream(layer, target, hooks)
        raise


def leave(layers: Sequence[Layer], old: Target | None, target: Target, hooks: LayerHooks) -> None:
    """Before a plan for ``target`` applies: layers on the previous device ``old`` (when it is another one) leave
    it, their patched weights restored to be patched again where they go; so does a layer on any third device
    (where another loader put it)."""
    switching = old is not None and not same_target(old, target)
    for layer in layers:
        stranded = not layer.is_resident(target) and not layer.is_resident(HOST)
        if stranded or (switching and layer.is_resident(old)):
            hooks.before_leaving(layer)
            to_host(layer)


def apply_plan(
    layers: Sequence[Layer], plan: Plan, target: Target, hooks: LayerHooks, progress: ProgressCallback | None
) -> None:
    """Make exactly ``plan``'s layers resident on ``target`` and stream the others, whatever happens.

    Room is freed first; layers that cannot stream move in before those that can, so an interrupted move (the
    progress callback raising) leaves a model that computes on its device. Every layer ends resident or
    streaming, even when a move raises.
    """
    outgoing, staying, incoming = _sort_out(layers, plan, target)
    steps = len(outgoing) + len(incoming)
    try:
        for done, layer in enumerate(outgoing, start=1):
            hooks.before_leaving(layer)
            to_host(layer)
            stream(layer, target, hooks, plan.slices.get(layer.name))
            _report(progress, done, steps)
        for layer in staying:  # resident already: the owner may still have to patch it (idempotent)
            hooks.before_resident(layer, target)
        for done, layer in enumerate(incoming, start=len(outgoing) + 1):
            make_resident(layer, target, hooks)
            _report(progress, done, steps)
    finally:
        for layer in layers:
            if layer.streamable and not layer.is_resident(target):
                stream(layer, target, hooks, plan.slices.get(layer.name))


def _sort_out(layers: Sequence[Layer], plan: Plan, target: Target) -> tuple[list[Layer], list[Layer], list[Layer]]:
    """The layers that leave ``target``, those that stay there, and those that come (unstreamable first)."""
    outgoing, staying, incoming = [], [], []
    for layer in layers:
        here = layer.is_resident(target)
        if layer.name not in plan.resident:
            if here:
                outgoing.append(layer)
        elif here and not is_streaming(layer):
            staying.append(layer)
        else:
            incoming.append(layer)
    incoming.sort(key=lambda layer: layer.streamable)  # a stable sort: the order of the model otherwise
    return outgoing, staying, incoming


def _report(progress: ProgressCallback | None, done: int, total: int) -> None:
    if progress is not None:
        progress(done, total)
