"""Offload To CPU on ComfyUI's MODEL, CLIP and VAE objects: models back to RAM, as the user asks.

Nothing is deleted: ComfyUI unloads the entries (its books stay true) and the next node that uses a model
loads it again where its placement says. The summary names the device each model's bytes left.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ...core.devices.inventory import DeviceInventory, InventorySnapshot
from ...core.devices.tensors import HOST
from ...core.errors import DeviceControlError, InvalidSizeError
from ...core.placement.engine import partial_model_of
from ...core.placement.eviction import make_room
from ...core.units import format_bytes, parse_size
from .. import surface
from .books import ComfyEntry, clone_entries, entries, unload_entries, where
from .reading import target_id
from .subjects import Subject, component_of, model_label, require_subject

log = logging.getLogger("device_control")

OFFLOAD_MODES = ("full", "free N GB", "all models", "all except this one")


def offload(value: Any | None, mode: str, amount: str, empty_cache: bool, inventory: DeviceInventory) -> str:
    """Move models back to RAM, as the user asked (keep-resident models included); what was freed where.

    Raises:
        DeviceControlError: an unknown mode, a mode that needs a model without one, or an unreadable amount.
    """
    if mode not in OFFLOAD_MODES:
        raise DeviceControlError(f"unknown mode {mode!r}; choose one of {', '.join(OFFLOAD_MODES)}.")
    subject = require_subject(value) if value is not None else None
    if subject is None and mode in ("full", "all except this one"):
        raise DeviceControlError(f"mode '{mode}' needs a model: connect one, or choose 'all models'.")
    snapshot = inventory.snapshot()
    if mode == "free N GB":
        done = _free(subject, _amount(amount), snapshot)
    else:
        done = _unload_all_of(_chosen(subject, mode), snapshot)
        if subject is not None and mode == "full":
            _detach_unlisted(subject)
    if empty_cache:
        surface.soft_empty_cache()
        inventory.empty_caches()
    text = _offload_summary(mode, amount, done)
    log.info("[Device Control] %s", text)
    return text


def _free(subject: Subject | None, wanted: int, snapshot: InventorySnapshot) -> list[Offloaded]:
    """``free N GB``: least recently used first, a model giving back only part of itself when that is enough
    (the same eviction that makes room for a move, with the models kept resident included: the user asked)."""
    candidates = [ComfyEntry(entry, lambda t: target_id(t, snapshot)) for entry in _free_candidates(subject)]
    given = make_room(candidates, None, wanted, include_kept=True).evicted
    return [Offloaded(g.name, g.device, g.freed, on_host=False) for g in given]


def _amount(text: str) -> int:
    try:
        return parse_size(text)
    except InvalidSizeError as exc:
        raise InvalidSizeError(f"free_amount: {exc}") from None


def _detach_unlisted(subject: Subject) -> None:
    """A model resident on a device without an entry in ComfyUI's list is still ours to free."""
    if partial_model_of(subject.patcher.model).target is not None:
        subject.patcher.detach()


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
    before = [(e, model_label(e.model), *_device_of(e, snapshot), int(e.model.loaded_size())) for e in chosen]
    unload_entries(chosen)
    return [Offloaded(name, device, max(0, size - _remaining(e)), host) for e, name, device, host, size in before]


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
