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
from ...core.placement import Target
from ...core.simulated import SimulatedDevice
from ...core.units import format_bytes, parse_size
from .. import surface
from .books import (
    clone_entries,
    entries,
    keep_entries,
    make_room_for,
    model_name,
    unload_entries,
    where,
)
from .patcher import DeviceControlPatcher, adopt, last_load
from .reading import component_of, target_id

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
    """Put ``value``'s model on ``device`` within ``vram_budget``, now.

    Raises:
        DeviceControlError: not a model, a malformed device or budget, a budget larger than the device, or no
            room even for the layers that cannot stream (the model stays in RAM).
    """
    subject = subject_of(value)
    snapshot = inventory.snapshot()
    target, chosen_id, warning = resolve_target(inventory, device, snapshot)
    placement = Placement(target, Budget.parse(vram_budget), keep_resident, device_id=chosen_id)
    budget = placement.budget_bytes()  # a budget larger than the device is refused here, before anything moves
    log.info("[Device Control] Move To GPU: moving %s to %s (budget %s)", subject.name, chosen_id, placement.budget)
    moved = clone_subject(subject)
    patcher = moved.patcher
    patcher.device_control_placement = placement
    patcher.load_device = torch.device("cpu") if isinstance(target, SimulatedDevice) else target
    if moved.kind == "VAE":
        moved.value.device = patcher.load_device  # the VAE sends its inputs there
    engine = partial_model_of(patcher.model)
    engine.limits.pop(getattr(target, "label", str(target)), None)  # the user asks again: try the full budget
    wanted = min(budget, engine.total_bytes()) - engine.resident_bytes(target)
    eviction = make_room_for(patcher, target, wanted) if wanted > 0 else None
    surface.load_models_gpu([patcher], force_full_load=moved.kind == "CLIP")
    keep_entries()
    report = last_load(patcher)
    lines = [f"{moved.name} {report.summary().replace(report.target, chosen_id)}" if report else moved.name]
    shown = str(placement.budget)
    shown += f" ({format_bytes(budget)})" if shown != format_bytes(budget) else ""
    lines.append(f"  budget {shown}" + ("; kept resident" if keep_resident else ""))
    if eviction is not None and eviction.summary():
        lines.append(f"  {eviction.summary()}")
    if warning:
        lines.append(f"  warning: {warning}")
    text = "\n".join(lines)
    log.info("[Device Control] Move To GPU: %s", text)
    return MoveResult(moved.value, text)


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
    lines: list[str] = []
    freed: dict[str, int] = {}

    def record(entry: Any, before: int) -> None:
        patcher = entry.model
        after = int(patcher.loaded_size()) if patcher is not None and entry in surface.loaded_model_list() else 0
        if before > after:
            name = target_id(where(entry), snapshot)
            freed[name] = freed.get(name, 0) + before - after
            lines.append(f"  {model_name(patcher)}: {format_bytes(before - after)} freed on {name}")

    if mode == "free N GB":
        wanted = parse_size(amount)
        if subject is not None:
            chosen = clone_entries(subject.patcher)
        else:
            chosen = [e for e in entries() if component_of(e.model.model) != "other"]
        for entry in reversed(chosen):  # least recently used first
            missing = wanted - sum(freed.values())
            if missing <= 0:
                break
            before = int(entry.model.loaded_size())
            if before <= 0:
                continue
            if missing < before:
                entry.model.partially_unload(entry.model.offload_device, missing)
            else:
                unload_entries([entry])
            record(entry, before)
    else:
        if mode == "full":
            chosen = clone_entries(subject.patcher)
        elif mode == "all models":
            chosen = entries()
        else:
            chosen = [e for e in entries() if not subject.patcher.is_clone(e.model)]
        befores = [(entry, int(entry.model.loaded_size())) for entry in chosen]
        unload_entries(chosen)
        for entry, before in befores:
            record(entry, before)
        if subject is not None and mode == "full":
            engine = partial_model_of(subject.patcher.model)
            if engine.target is not None:  # resident without an entry in ComfyUI's list: still ours to free
                subject.patcher.detach()
    if empty_cache:
        surface.soft_empty_cache()
        for device in inventory.simulated:
            device.empty_cache()
    total = sum(freed.values())
    head = f"Offload To CPU ({mode}): {format_bytes(total)} freed" + (
        " (" + ", ".join(f"{name} {format_bytes(n)}" for name, n in freed.items()) + ")" if freed else ""
    )
    if mode == "free N GB" and total < parse_size(amount):
        head += f"; {format_bytes(parse_size(amount) - total)} of {amount} could not be freed (nothing more loaded)"
    text = "\n".join([head, *lines])
    log.info("[Device Control] %s", text)
    return text
