"""Move To GPU and Offload To CPU on ComfyUI's MODEL, CLIP and VAE objects.

A move works on a clone (ComfyUI's values are shared between nodes, so the input itself is never changed):
the clone's patcher carries the placement, the VAE object its device. The weights are the same tensors,
moved in place — nothing is read from disk again and the dtype never changes. The move itself is
ComfyUI's ``load_models_gpu``, which calls our patcher, so ComfyUI's list and sizes are right afterwards.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ...core.budget import Budget
from ...core.devices import DeviceInventory, InventorySnapshot
from ...core.errors import DeviceControlError
from ...core.loading import Placement, partial_model_of
from ...core.placement import HOST, Target, label_of
from ...core.simulated import SimulatedDevice
from ...core.units import format_bytes, parse_size
from .. import surface
from .books import (
    clone_entries,
    entries,
    in_force,
    keep_entries,
    make_room_for,
    model_name,
    unload_entries,
    where,
)
from .patcher import DeviceControlPatcher, adopt, last_load
from .reading import component_of, residency_of, target_id

log = logging.getLogger("device_control")


@dataclass
class Subject:
    """A MODEL, CLIP or VAE value and the patcher behind it."""

    kind: str
    value: Any
    patcher: Any

    @property
    def name(self) -> str:
        """``SD15 diffusion model``, ``text encoder (SD1ClipModel)``, ``VAE (AutoencoderKL)``."""
        if self.kind == "MODEL":
            return model_name(self.patcher)
        noun = {"CLIP": "text encoder", "VAE": "VAE"}[self.kind]
        return f"{noun} ({type(self.patcher.model).__name__})"


def subject_of(value: Any) -> Subject:
    """Tell a MODEL, a CLIP and a VAE apart.

    Raises:
        DeviceControlError: the value is none of them.
    """
    if hasattr(value, "model_size") and hasattr(value, "loaded_size") and hasattr(value, "model"):
        return Subject("MODEL", value, value)
    patcher = getattr(value, "patcher", None)
    if patcher is not None and hasattr(value, "cond_stage_model"):
        return Subject("CLIP", value, patcher)
    if patcher is not None and hasattr(value, "first_stage_model"):
        return Subject("VAE", value, patcher)
    raise DeviceControlError(
        f"a {type(value).__name__} cannot be moved: connect a MODEL, a CLIP or a VAE to the model input."
    )


def _classic_clone(patcher: Any) -> Any:
    """A clone of ``patcher`` that ComfyUI loads the classic way (our engine), even under Dynamic VRAM."""
    if not surface.is_dynamic(patcher):
        return patcher.clone()
    try:
        return patcher.clone(disable_dynamic=True)
    except (TypeError, RuntimeError) as exc:
        raise DeviceControlError(
            "this model is managed by ComfyUI's Dynamic VRAM and cannot be rebuilt for explicit placement "
            f"({exc}); load it with Load Checkpoint With Device, or start ComfyUI with --disable-dynamic-vram."
        ) from exc


def clone_subject(subject: Subject) -> Subject:
    """A clone sharing the weights, whose patcher is a :class:`DeviceControlPatcher`."""
    if subject.kind == "MODEL":
        patcher = _classic_clone(subject.patcher)
        value = patcher
    elif subject.kind == "CLIP":
        value = subject.value.clone()
        if surface.is_dynamic(value.patcher):
            value.patcher = _classic_clone(subject.patcher)
        patcher = value.patcher
    else:
        value = copy.copy(subject.value)  # ComfyUI's VAE has no clone(); its patcher does
        value.patcher = _classic_clone(subject.patcher)
        patcher = value.patcher
    if not isinstance(patcher, DeviceControlPatcher):
        adopt(patcher, None)
    return Subject(subject.kind, value, patcher)


def resolve_target(
    inventory: DeviceInventory, text: str, snapshot: InventorySnapshot
) -> tuple[Target, str, str | None]:
    """``(target, device id, warning)`` for a device string; a device this machine lacks falls back to auto."""
    resolution = inventory.resolve(text, fallback=True, snapshot=snapshot)
    info = resolution.device
    simulated = inventory.simulated_device(info.id, snapshot)
    target: Target = simulated if simulated is not None else torch.device(info.torch_device or "cpu")
    return target, info.id, resolution.warning


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
        DeviceControlError: not a model, a malformed device or budget, a budget larger than the device, no
            room even for the layers that cannot stream (the model stays in RAM), or a load that did not go
            through Device Control.
    """
    subject = subject_of(value)
    snapshot = inventory.snapshot()
    target, chosen_id, warning = resolve_target(inventory, device, snapshot)
    placement = Placement(target, Budget.parse(vram_budget), keep_resident, device_id=chosen_id)
    budget = placement.budget_bytes()  # a budget larger than the device is refused here, before anything moves
    before = state_before(subject, snapshot)
    log.info("[Device Control] Move To GPU: moving %s to %s (budget %s)", subject.name, chosen_id, placement.budget)
    moved = clone_subject(subject)
    patcher = moved.patcher
    patcher.device_control_placement = placement
    patcher.load_device = torch.device("cpu") if isinstance(target, SimulatedDevice) else target
    if moved.kind == "VAE":
        moved.value.device = patcher.load_device  # the VAE sends its inputs there
    engine = partial_model_of(patcher.model)
    engine.limits.pop(label_of(target), None)  # the user asks again: try the full budget
    wanted = min(budget, engine.total_bytes()) - engine.resident_bytes(target)
    eviction = make_room_for(patcher, target, wanted) if wanted > 0 else None
    previous = last_load(patcher)
    surface.load_models_gpu([patcher], force_full_load=moved.kind == "CLIP")
    keep_entries()
    if not in_force(patcher):
        raise DeviceControlError(
            f"Move To GPU could not place {moved.name} on {chosen_id}: ComfyUI's load did not go through Device "
            f"Control, and the model is now {where_now(patcher, snapshot)}. Another custom node pack may replace "
            "ComfyUI's model loading (load_models_gpu or the ModelPatcher's load methods): disable it and queue "
            "again, or report this with the VRAM Report's JSON output."
        )
    report = last_load(patcher)
    oom = report.oom if report is not None and report is not previous else None
    lines = [f"{moved.name} {engine.describe(chosen_id, budget, oom=oom).summary()}"]
    shown = str(placement.budget)
    shown += f" ({format_bytes(budget)})" if shown != format_bytes(budget) else ""
    lines.append(f"  budget {shown}" + ("; kept resident" if keep_resident else ""))
    lines.append(f"  before: {before}")
    if eviction is not None and eviction.summary():
        lines.append(f"  {eviction.summary()}")
    if warning:
        lines.append(f"  warning: {warning}")
    text = "\n".join(lines)
    log.info("[Device Control] Move To GPU: %s", text)
    return MoveResult(moved.value, text)


def where_now(patcher: Any, snapshot: InventorySnapshot) -> str:
    """``3.20 GiB on cpu, loaded by ComfyUI``: where a model's weights are, and whose placement that is."""
    residency = residency_of(patcher, snapshot)
    where = ", ".join(f"{format_bytes(n)} on {device}" for device, n in residency.resident if n) or "nowhere"
    if residency.managed_by == "Device Control":
        budget = f", budget {residency.budget}" if residency.budget else ""
        return f"{where}, placed by Device Control{budget}"
    return f"{where}, loaded by ComfyUI"


def state_before(subject: Subject, snapshot: InventorySnapshot) -> str:
    """Where the model was before a move, for its summary: loaded by whom and where, or not loaded."""
    loaded = clone_entries(subject.patcher)
    if not loaded:
        return "not loaded (weights in RAM)"
    return where_now(loaded[0].model, snapshot)


OFFLOAD_MODES = ("full", "free N GB", "all models", "all except this one")


def offload(value: Any | None, mode: str, amount: str, empty_cache: bool, inventory: DeviceInventory) -> str:
    """Move models back to RAM, as the user asked (keep-resident models included); what was freed where.

    Raises:
        DeviceControlError: an unknown mode, a mode that needs a model without one, or an unreadable amount.
    """
    if mode not in OFFLOAD_MODES:
        raise DeviceControlError(f"unknown mode {mode!r}; choose one of {', '.join(OFFLOAD_MODES)}.")
    subject = subject_of(value) if value is not None else None
    if subject is None and mode in ("full", "all except this one"):
        raise DeviceControlError(f"mode '{mode}' needs a model: connect one, or choose 'all models'.")
    snapshot = inventory.snapshot()
    if mode == "free N GB":
        done = _free_amount(_free_candidates(subject), parse_size(amount), snapshot)
    else:
        done = _unload_all_of(_chosen(subject, mode), snapshot)
        if subject is not None and mode == "full":
            engine = partial_model_of(subject.patcher.model)
            if engine.target is not None:  # resident without an entry in ComfyUI's list: still ours to free
                subject.patcher.detach()
    if empty_cache:
        surface.soft_empty_cache()
        for device in inventory.simulated:
            device.empty_cache()
    text = _offload_summary(mode, amount, done)
    log.info("[Device Control] %s", text)
    return text


@dataclass(frozen=True)
class Offloaded:
    """One model taken off its device: its name, the device (our id), bytes freed there, and whether that
    device is the host (a model that computed on the CPU frees no device memory: its weights stay in RAM)."""

    name: str
    device: str
    freed: int
    on_host: bool


def _chosen(subject: Subject | None, mode: str) -> list[Any]:
    """The ComfyUI entries a ``full``, ``all models`` or ``all except this one`` offload unloads."""
    if mode == "full":
        return clone_entries(subject.patcher)
    if mode == "all models":
        return entries()
    return [e for e in entries() if not subject.patcher.is_clone(e.model)]


def _free_candidates(subject: Subject | None) -> list[Any]:
    """The entries ``free N GB`` may take from: the model's own, or every model's, most recently used first."""
    if subject is not None:
        return clone_entries(subject.patcher)
    return [e for e in entries() if component_of(e.model.model) != "other"]


def _device_of(entry: Any, snapshot: InventorySnapshot) -> tuple[str, bool]:
    """Our id for the device an entry's model is loaded on (read before it leaves), and whether it is the host."""
    device = where(entry)
    return target_id(device, snapshot), isinstance(device, torch.device) and device == HOST


def _remaining(entry: Any) -> int:
    patcher = entry.model
    return int(patcher.loaded_size()) if patcher is not None and entry in surface.loaded_model_list() else 0


def _unload_all_of(chosen: list[Any], snapshot: InventorySnapshot) -> list[Offloaded]:
    before = [(e, model_name(e.model), *_device_of(e, snapshot), int(e.model.loaded_size())) for e in chosen]
    unload_entries(chosen)
    return [Offloaded(name, device, max(0, size - _remaining(e)), host) for e, name, device, host, size in before]


def _free_amount(chosen: list[Any], wanted: int, snapshot: InventorySnapshot) -> list[Offloaded]:
    """Free ``wanted`` bytes of device memory, least recently used models first, a model giving back only part
    of itself (streaming more) when that is enough."""
    done: list[Offloaded] = []
    for entry in reversed(chosen):
        missing = wanted - sum(step.freed for step in done)
        if missing <= 0:
            break
        device, on_host = _device_of(entry, snapshot)
        before = int(entry.model.loaded_size())
        if before <= 0 or on_host:
            continue  # in RAM already: unloading it would free no device memory
        if missing < before:
            entry.model.partially_unload(entry.model.offload_device, missing)
        else:
            unload_entries([entry])
        done.append(Offloaded(model_name(entry.model), device, max(0, before - _remaining(entry)), False))
    return done


def _offload_summary(mode: str, amount: str, done: list[Offloaded]) -> str:
    """``Offload To CPU (full): 3.20 GiB freed (gpu:0 3.20 GiB)`` and a line per model."""
    freed: dict[str, int] = {}
    lines: list[str] = []
    for step in done:
        if step.on_host:
            lines.append(f"  {step.name}: in RAM already (it computed on {step.device}); unloaded from ComfyUI's list")
        elif step.freed:
            freed[step.device] = freed.get(step.device, 0) + step.freed
            lines.append(f"  {step.name}: {format_bytes(step.freed)} freed on {step.device}")
    total = sum(freed.values())
    head = f"Offload To CPU ({mode}): {format_bytes(total)} freed" + (
        " (" + ", ".join(f"{name} {format_bytes(n)}" for name, n in freed.items()) + ")" if freed else ""
    )
    if mode == "free N GB" and total < parse_size(amount):
        head += f"; {format_bytes(parse_size(amount) - total)} of {amount} could not be freed (nothing more loaded)"
    return "\n".join([head, *lines])
