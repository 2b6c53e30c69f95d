"""The one place that reads ComfyUI's model objects (ModelPatcher, LoadedModel, CLIP, VAE).

It turns them into ``core`` records (``ModelResidency``, ``MemoryMode``) so the rest of the pack never
depends on ComfyUI's internals. Reading must survive ComfyUI changing its list while we read it: a model
freed in the meantime, or one whose sizes cannot be read, becomes a note instead of an exception.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ...core.detection.ggml_types import GGML_TYPES
from ...core.devices.inventory import InventorySnapshot
from ...core.devices.tensors import label_of
from ...core.monitor.report import MemoryMode, ModelResidency
from ...core.placement.engine import engine_of
from ...core.placement.split_model import SplitModel, split_of
from ...core.units import format_bytes
from .. import surface
from .books import holding_of, placement_of
from .dynamic_vram import dynamic_vram_enabled, is_dynamic
from .pinning import pinned_figures
from .split_books import is_part
from .storage import dominant_storage, quantised_label
from .subjects import component_of, model_label

_VRAM_STATES = {
    "DISABLED": "CPU only: ComfyUI manages no GPU memory (started with --cpu, or no GPU found)",
    "NO_VRAM": "no VRAM: every layer streams from RAM when it runs (--novram)",
    "LOW_VRAM": "low VRAM: models are split, part stays in RAM and streams (--lowvram or a small GPU)",
    "NORMAL_VRAM": "normal: models load fully when they fit, partially when they do not",
    "HIGH_VRAM": "high VRAM: models stay on the GPU after use (--highvram / --gpu-only)",
    "SHARED": "shared memory: GPU and CPU use the same RAM (Apple silicon, integrated GPUs)",
}


def device_id(device: Any, snapshot: InventorySnapshot) -> str:
    """Our id (``gpu:0``, ``cpu``) for a ``torch.device`` ComfyUI uses."""
    kind = getattr(device, "type", str(device))
    if kind == "cpu":
        return "cpu"
    index = getattr(device, "index", None) or 0
    native = "mps" if kind == "mps" else f"{kind}:{index}"
    found = next((d for d in snapshot.devices if d.native == native), None)
    return found.id if found is not None else native


def target_id(target: Any, snapshot: InventorySnapshot) -> str:
    """Our id (``gpu:0``) for a placement target: a ``torch.device``, or a device object torch does not know."""
    if target is None:
        return "unknown device"
    if isinstance(target, torch.device):
        return device_id(target, snapshot)
    label = label_of(target)
    return next((d.id for d in snapshot.devices if d.native == label), label)


def residency_of(patcher: Any, snapshot: InventorySnapshot, *, in_use: bool = True) -> ModelResidency:
    """Describe one ModelPatcher: size, bytes on its compute device and on its offload device (on every device
    of a split model)."""
    model = patcher.model
    held = split_of(model)
    if held is not None:
        return _split_residency(patcher, held, snapshot, in_use)
    component = component_of(model)
    total = int(patcher.model_size())
    loaded = int(patcher.loaded_size())
    compute = device_id(patcher.load_device, snapshot)
    holding = holding_of(model)
    if holding is not None:  # ours: where the weights are, not what ComfyUI assumes
        loaded = min(engine_of(model).resident_bytes(holding.target), total)
        compute = target_id(holding.target, snapshot)  # ComfyUI's load device is the host for some devices
    offload = device_id(patcher.offload_device, snapshot)
    resident = [(compute, loaded)]
    if total > loaded:
        if offload == compute:
            resident = [(compute, total)]
        else:
            resident.append((offload, total - loaded))
    dtype = _storage_dtype(patcher)
    partial = bool(getattr(model, "model_lowvram", False)) or (0 < loaded < total)
    placement = holding.placement if holding is not None else None
    return ModelResidency(
        name=model_label(patcher, with_class=False),
        component=component,
        model_class=type(model).__name__,
        total_bytes=total,
        resident=tuple(resident),
        compute_device=compute,
        partial=partial,
        dtype=dtype,
        managed_by=_manager(patcher, holding),
        in_use=in_use,
        key=model_key(patcher),
        kept=bool(placement and placement.keep_resident),
        budget=str(placement.budget) if placement is not None else None,
        note=_pending_note(patcher, holding, loaded),
    )


def _split_residency(patcher: Any, held: SplitModel, snapshot: InventorySnapshot, in_use: bool) -> ModelResidency:
    """A model split over devices: the bytes on each device of the split (the rest in RAM), computing on the first."""
    total = int(patcher.model_size())
    resident = _split_bytes(held, snapshot, total)
    on_host = dict(resident).get("cpu", 0)
    dtype = _storage_dtype(patcher)
    return ModelResidency(
        name=model_label(patcher, with_class=False),
        component=component_of(patcher.model),
        model_class=type(patcher.model).__name__,
        total_bytes=total,
        resident=tuple(resident),
        compute_device=target_id(next(iter(held.targets.values())), snapshot),
        partial=held.mode == "stream" or on_host > 0,
        dtype=dtype,
        managed_by="Device Control",
        in_use=in_use,
        key=model_key(patcher),
        budget=f"split ({held.mode}): {', '.join(f'{d} {format_bytes(n)}' for d, n in resident)}",
    )


def _split_bytes(held: SplitModel, snapshot: InventorySnapshot, total: int) -> list[tuple[str, int]]:
    """``(device, bytes)`` of a split model: each device holding some of it, then RAM for the rest."""
    on_devices = [(target_id(t, snapshot), held.resident_bytes(t)) for t in held.targets.values()]
    resident = [(device, n) for device, n in on_devices if n and device != "cpu"]
    on_host = total - sum(n for _device, n in resident)
    return resident + ([("cpu", on_host)] if on_host > 0 else [])


def _manager(patcher: Any, holding: Any) -> str:
    """Who decides where the weights are: our engine, ComfyUI's Dynamic VRAM (which moves them itself, per
    layer, while sampling: no fixed placement to report), or ComfyUI's classic loader."""
    if holding is not None:
        return "Device Control"
    return "ComfyUI Dynamic VRAM" if is_dynamic(patcher) else "ComfyUI"


def _pending_note(patcher: Any, holding: Any, loaded: int) -> str | None:
    """What a VRAM Report says of a placement that this value carries but that is not in force now."""
    own = placement_of(patcher)
    if own is None or (holding is not None and holding.placement == own):
        return None
    where = f"{own.name}, budget {own.budget}" + (", kept resident" if own.keep_resident else "")
    if holding is None and loaded <= 0:
        return f"placed by Device Control ({where}): not loaded now; loads there when a node next uses it"
    return (
        f"placed by Device Control ({where}), not in force now: these weights were loaded another way since "
        "(ComfyUI's own nodes, another branch of the graph, or another move); the placement applies again when a "
        "node next uses this model"
    )


def model_key(patcher: Any) -> str:
    """The panel's name for a loaded model: its module tree's identity (shared by every clone of it)."""
    return f"m{id(patcher.model):x}"


def _storage_dtype(patcher: Any) -> str | None:
    """How the model is stored: a GGUF model's GGML types (``Q4_K_M: Q4_K/Q6_K blocks, F32 plain``:
    ``storage_label``), else the dtype ComfyUI reports for it, else the one most weights use (CLIP and VAE report
    none)."""
    quantised = quantised_label(patcher.model)
    if quantised is not None:
        return quantised
    stored = dominant_storage(patcher.model)
    if stored is not None and (stored in GGML_TYPES or stored.startswith("GGML type")):
        return stored
    dtype = patcher.model_dtype() if hasattr(patcher, "model_dtype") else None
    return str(dtype).replace("torch.", "") if dtype is not None else stored


def loaded_models(
    snapshot: InventorySnapshot, entries: Iterable[Any] | None = None
) -> tuple[list[ModelResidency], list[str]]:
    """Every model in ComfyUI's ``current_loaded_models``, and notes about entries that could not be read.

    Args:
        snapshot: the inventory snapshot used to name devices.
        entries: ComfyUI ``LoadedModel`` objects (default: a copy of ``current_loaded_models``).
    """
    models: list[ModelResidency] = []
    notes: list[str] = []
    seen: set[int] = set()
    for entry in surface.loaded_models() if entries is None else list(entries):
        patcher = getattr(entry, "model", None)
        if patcher is None:
            notes.append("a model in ComfyUI's list was freed while the report was being made; it is not listed")
            continue
        if is_part(patcher):  # the split model's own entry lists this device's bytes too
            continue
        if id(patcher.model) in seen:  # two entries for clones of one model: its memory is listed once
            continue
        seen.add(id(patcher.model))
        try:
            models.append(residency_of(patcher, snapshot, in_use=bool(getattr(entry, "currently_used", True))))
        except Exception as exc:  # one unreadable model must not hide the others
            what = type(getattr(patcher, "model", patcher)).__name__
            notes.append(f"could not read {what}: {type(exc).__name__}: {exc}")
    return models, notes


def memory_mode(snapshot: InventorySnapshot) -> MemoryMode:
    """ComfyUI's memory management mode, read from ``comfy.model_management``."""
    mm = surface.model_management()
    vram_state = getattr(getattr(mm, "vram_state", None), "name", "unknown")
    cpu_state = getattr(getattr(mm, "cpu_state", None), "name", "unknown")
    dynamic = dynamic_vram_enabled()
    dynamic_text = {
        None: "not available in this ComfyUI",
        True: "on (ComfyUI places the models it loads; models placed by Device Control use the classic loader)",
        False: "off",
    }[dynamic]
    try:
        compute = device_id(mm.get_torch_device(), snapshot)
    except Exception as exc:  # ComfyUI raises here when its chosen device vanished
        compute = f"unknown ({type(exc).__name__}: {exc})"
    pinned = getattr(mm, "TOTAL_PINNED_MEMORY", None)
    return MemoryMode(
        vram_state=vram_state,
        description=_VRAM_STATES.get(vram_state, "unknown mode"),
        cpu_state=cpu_state,
        compute_device=compute,
        smart_memory=not bool(getattr(mm, "DISABLE_SMART_MEMORY", False)),
        dynamic_vram=dynamic_text,
        pinned_bytes=int(pinned) if isinstance(pinned, (int, float)) else None,
        **pinned_figures(),
    )
