"""Move To GPU on ComfyUI's MODEL, CLIP and VAE objects (Offload To CPU: ``bridge.offloads``).

A move works on a clone (ComfyUI's values are shared between nodes, so the input itself is never changed):
the clone's patcher carries the placement, the VAE object its device. The weights are the same tensors,
moved in place — nothing is read from disk again, and the dtype changes only for a diffusion model loaded with
``auto``, to ComfyUI's choice for the new device (``bridge.auto_dtype``). The move itself is
ComfyUI's ``load_models_gpu``, which calls our patcher, so ComfyUI's list and sizes are right afterwards.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

from ...core.devices.backends import backend_of
from ...core.devices.inventory import DeviceInventory, InventorySnapshot
from ...core.devices.tensors import Target, label_of
from ...core.errors import DeviceControlError
from ...core.placement.budget import Budget, Placement
from ...core.placement.crossing import cross_to_placement
from ...core.placement.engine import partial_model_of
from ...core.placement.eviction import Eviction
from ...core.units import format_bytes
from .. import surface
from .auto_dtype import follow_auto
from .books import (
    clone_entries,
    in_force,
    keep_entries,
    make_room_for,
)
from .dynamic_vram import classic_clone, is_dynamic
from .fallback import resolve_or_fallback
from .foreign import placeable
from .patcher import DeviceControlPatcher, adopt, last_load
from .reading import residency_of
from .subjects import KIND_NOUNS, Subject, require_subject

log = logging.getLogger("device_control")


#: Said when the model came from ComfyUI's Dynamic VRAM: what was placed is a classic copy ComfyUI made of it.
DYNAMIC_NOTE = (
    "ComfyUI's Dynamic VRAM manages this model: placed is the classic copy ComfyUI builds of it from the model's "
    "file; the dynamic model itself stays as ComfyUI keeps it"
)


#: What to do when ComfyUI cannot rebuild a Dynamic VRAM model the classic way, by kind: a MODEL, CLIP or VAE has
#: loaders of ours; ComfyUI's loaders of the other kinds record no way to rebuild theirs (``cached_patcher_init``).
_INSTEAD = {
    "MODEL": "load it with Load Checkpoint With Device or Load Diffusion Model With Device",
    "CLIP": "load it with Load Checkpoint With Device or Load Text Encoders With Device",
    "VAE": "load it with Load Checkpoint With Device or Load VAE With Device",
}


def _classic_clone(subject: Subject) -> Any:
    """A clone of ``subject``'s patcher that ComfyUI loads the classic way (our engine), even under Dynamic VRAM."""
    patcher = subject.patcher
    if not is_dynamic(patcher):
        return patcher.clone()
    try:
        return classic_clone(patcher)
    except (TypeError, RuntimeError) as exc:
        restart = "start ComfyUI with --disable-dynamic-vram (every model then loads the classic way)"
        instead = _INSTEAD.get(subject.kind)
        fix = (
            f"{instead}, or {restart}"
            if instead
            else f"ComfyUI's loader of a {KIND_NOUNS[subject.kind]} records no way to rebuild it: {restart}"
        )
        raise DeviceControlError(
            f"{subject.name} is managed by ComfyUI's Dynamic VRAM and cannot be rebuilt for explicit placement "
            f"({exc}); {fix}."
        ) from exc


def clone_subject(subject: Subject) -> Subject:
    """A clone sharing the weights, whose patcher is a :class:`DeviceControlPatcher`: ComfyUI's value (a cached
    loader's output, another branch's input) is never changed."""
    if subject.kind in ("MODEL", "MODEL_PATCH", "GLIGEN"):  # the value is its patcher
        value = patcher = _classic_clone(subject)
    elif subject.kind == "CLIP":
        value = subject.value.clone()
        if is_dynamic(value.patcher):
            value.patcher = _classic_clone(subject)
        patcher = value.patcher
    elif subject.kind == "CONTROL_NET":
        value = subject.value.copy()  # ComfyUI's copy shares the patcher: the clone gets its own
        value.control_model_wrapped = patcher = _classic_clone(subject)
    else:  # a VAE, a CLIP vision model, an upscale model: no clone() of their own; their patchers have one
        value = copy.copy(subject.value)
        value.patcher = patcher = _classic_clone(subject)
    if not isinstance(patcher, DeviceControlPatcher):
        adopt(patcher, None)
    return Subject(subject.kind, value, patcher)


def resolve_target(
    inventory: DeviceInventory, text: str, snapshot: InventorySnapshot
) -> tuple[Target, str, str | None]:
    """``(target, device id, warning)`` for a device string; a device this machine lacks falls back to auto, by the
    rule and in the words of the loaders (``bridge.fallback``)."""
    info, warning = resolve_or_fallback(inventory, text, snapshot)
    if info is None:
        info = inventory.resolve("auto", snapshot=snapshot).device
    return inventory.target(info.id, snapshot), info.id, warning


@dataclass
class MoveResult:
    """The moved value and what to tell the user."""

    value: Any
    text: str


def move(value: Any, device: str, vram_budget: str, keep_resident: bool, inventory: DeviceInventory) -> MoveResult:
    """Put ``value``'s model on ``device`` within ``vram_budget``, now, whatever state it was in.

    The model may be loaded already: by ComfyUI (an earlier run with its own nodes, another branch of the graph
    using a clone of it, fully or in low-VRAM mode), or by us for another device or budget. The load goes
    through ComfyUI's ``load_models_gpu``, whose books stay true; our patcher takes the weights over from
    whatever state they are in (see ``DeviceControlPatcher._take_over``). Afterwards the placement is checked
    on the weights themselves: a move that did not happen is an error, never a success.

    Raises:
        DeviceControlError: not a model, a malformed device or budget, a budget larger than the device, no room
            even for the layers that cannot stream (the model stays in RAM), or a load that did not go through
            Device Control.
        ModelFileError: a model another pack keeps quantised holds a GGML type we do not read.
    """
    subject = require_subject(value)
    snapshot = inventory.snapshot()
    target, chosen_id, warning = resolve_target(inventory, device, snapshot)
    placement = Placement(target, Budget.parse(vram_budget), keep_resident, device_id=chosen_id)
    budget = placement.budget_bytes()  # a budget larger than the device is refused here, before anything moves
    subject = placeable(subject)  # a model another pack keeps quantised: our copy of it
    notes = [f"before: {state_before(subject, snapshot)}"]
    if is_dynamic(subject.patcher):
        notes.append(DYNAMIC_NOTE)
    log.info("[Device Control] Move To GPU: moving %s to %s (budget %s)", subject.name, chosen_id, placement.budget)
    moved = placed_clone(subject, placement)
    if moved.kind == "MODEL":
        notes.append(follow_auto(moved.patcher, subject.patcher, moved.patcher.load_device, chosen_id) or "")
    eviction = _make_room(moved.patcher, target, budget)
    previous = last_load(moved.patcher)
    surface.load_models_gpu([moved.patcher], force_full_load=moved.kind == "CLIP")
    keep_entries()
    _check_in_force(moved, chosen_id, snapshot)
    report = last_load(moved.patcher)
    oom = report.oom if report is not None and report is not previous else None
    notes += [eviction.summary() if eviction else "", f"warning: {warning}" if warning else ""]
    text = _move_summary(moved, placement, budget, oom, notes)
    log.info("[Device Control] Move To GPU: %s", text)
    return MoveResult(moved.value, text)


def placed_clone(subject: Subject, placement: Placement) -> Subject:
    """A clone of ``subject`` that carries ``placement`` (its patcher loads there; a VAE sends its inputs there; a
    ControlNet's calls cross to it from its diffusion model's device)."""
    moved = clone_subject(subject)
    patcher = moved.patcher
    patcher.device_control_placement = placement
    patcher.device_control_split = None  # a split the input carried ends here
    target = placement.target
    patcher.load_device = backend_of(target).comfy_device(target)
    if moved.kind == "VAE":
        moved.value.device = patcher.load_device
    elif moved.kind == "CLIP_VISION":  # its encode sends the image to its own load device, not its patcher's
        moved.value.load_device = patcher.load_device
    elif moved.kind == "CONTROL_NET":  # called with its diffusion model's tensors, on that model's device
        cross_to_placement(patcher.model)
    return moved


def _make_room(patcher: Any, target: Target, budget: int) -> Eviction | None:
    """Room for what the placement will add on ``target``, from other models (least recently used first)."""
    engine = partial_model_of(patcher.model)
    engine.limits.pop(label_of(target), None)  # the user asks again: try the full budget
    wanted = min(budget, engine.total_bytes()) - engine.resident_bytes(target)
    return make_room_for(patcher, target, wanted) if wanted > 0 else None


def _check_in_force(moved: Subject, device: str, snapshot: InventorySnapshot) -> None:
    """Raise unless the weights are where the move put them (never report a move that did not happen)."""
    if in_force(moved.patcher):
        return
    raise DeviceControlError(
        f"Move To GPU could not place {moved.name} on {device}: ComfyUI's load did not go through Device "
        f"Control, and the model is now {where_now(moved.patcher, snapshot)}. Another custom node pack may "
        "replace ComfyUI's model loading (load_models_gpu or the ModelPatcher's load methods): disable it and "
        "queue again, or report this with the VRAM Report's JSON output."
    )


def _move_summary(moved: Subject, placement: Placement, budget: int, oom: str | None, notes: list[str]) -> str:
    """Where the model is now (read from its weights), its budget, then ``notes`` (empty ones left out)."""
    engine = partial_model_of(moved.patcher.model)
    shown = str(placement.budget)
    shown += f" ({format_bytes(budget)})" if shown != format_bytes(budget) else ""
    lines = [
        f"{moved.name} {engine.describe(placement.name, budget, oom=oom).summary()}",
        f"  budget {shown}" + ("; kept resident" if placement.keep_resident else ""),
    ]
    return "\n".join(lines + [f"  {note}" for note in notes if note])


def where_now(patcher: Any, snapshot: InventorySnapshot) -> str:
    """``3.20 GiB on cpu, loaded by ComfyUI``: where a model's weights are, and whose placement that is."""
    residency = residency_of(patcher, snapshot)
    where = ", ".join(f"{format_bytes(n)} on {device}" for device, n in residency.resident if n) or "nowhere"
    if residency.managed_by == "Device Control":
        budget = f", budget {residency.budget}" if residency.budget else ""
        return f"{where}, placed by Device Control{budget}"
    return f"{where}, loaded by {residency.managed_by}"


def state_before(subject: Subject, snapshot: InventorySnapshot) -> str:
    """Where the model was before a move, for its summary: loaded by whom and where, or not loaded."""
    loaded = clone_entries(subject.patcher)
    if not loaded:
        return "not loaded (weights in RAM)"
    return where_now(loaded[0].model, snapshot)
