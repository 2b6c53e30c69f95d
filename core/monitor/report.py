"""The memory report: devices, host RAM, resident models and the memory mode, as text and as JSON.

The report is assembled from plain records so that it can describe models built by ComfyUI (the
``nodes`` layer converts them) and plain torch models alike. Rendering never raises on missing
figures: an unknown number prints as ``n/a``, a failed query as its error.
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from typing import Any

import torch

from ..devices.backends import DeviceInfo
from ..devices.inventory import HostMemory, InventorySnapshot
from ..devices.peaks import PEAKS_ENV
from ..units import format_bytes


@dataclass(frozen=True)
class ModelResidency:
    """Where one model's weights are, right now.

    Args:
        name: what users call it (``"SD15 diffusion model"``).
        component: ``"MODEL"``, ``"CLIP"``, ``"VAE"`` or ``"other"``.
        model_class: the Python class of the module tree (``"BaseModel"``, ``"SD1ClipModel"``).
        total_bytes: bytes of all its weights.
        resident: ``(device_id, bytes)`` pairs: how much of it is on each device.
        compute_device: the device it computes on (ComfyUI's load device).
        partial: part of it stays off the compute device and streams in when used.
        dtype: the storage dtype of its weights, when known.
        managed_by: who decides its placement (``"ComfyUI"``, ``"ComfyUI Dynamic VRAM"`` or ``"Device Control"``).
        in_use: ComfyUI's ``currently_used`` flag (False means it is first in line to be unloaded).
        key: a stable name for this model while it is loaded (the panel's actions refer to it).
        kept: placed with keep-resident: it is not evicted to make room.
        budget: the VRAM budget it was placed with (``"all"``, ``"1.50 GiB"``, ``"50%"``), if any.
        note: a placement this value carries that is not in force now, and when it will be.
    """

    name: str
    component: str
    model_class: str
    total_bytes: int
    resident: tuple[tuple[str, int], ...]
    compute_device: str
    partial: bool
    dtype: str | None = None
    managed_by: str = "ComfyUI"
    in_use: bool = True
    key: str = ""
    kept: bool = False
    budget: str | None = None
    note: str | None = None


@dataclass(frozen=True)
class MemoryMode:
    """How the host application manages memory (ComfyUI's VRAM state, smart memory, Dynamic VRAM)."""

    vram_state: str
    description: str
    cpu_state: str
    compute_device: str
    smart_memory: bool
    dynamic_vram: str
    pinned_bytes: int | None = None  # ComfyUI's own page-locked host memory
    comfy_pinned_cap: int | None = None  # ComfyUI's cap on it (0: it pins nothing)
    pack_pinned_bytes: int | None = None  # this pack's
    pinned_cap: int | None = None  # the one cap both are counted against (``core.devices.pinned``)


@dataclass(frozen=True)
class MemoryReport:
    """Everything the VRAM Report node shows, at one moment."""

    label: str
    devices: tuple[DeviceInfo, ...]
    errors: tuple[str, ...]
    host: HostMemory
    models: tuple[ModelResidency, ...]
    mode: MemoryMode | None
    subject: ModelResidency | None = None
    notes: tuple[str, ...] = ()
    versions: dict[str, str] = field(default_factory=dict)
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary (bytes as integers, so bug reports lose no precision)."""
        data = _shallow(self)
        data["devices"] = [{**_shallow(d), "used": d.used} for d in self.devices]
        data["errors"] = list(self.errors)
        data["host"] = {**_shallow(self.host), "used": self.host.used}
        data["models"] = [_model_dict(m) for m in self.models]
        data["mode"] = _shallow(self.mode) if self.mode is not None else None
        data["subject"] = _model_dict(self.subject) if self.subject is not None else None
        data["notes"] = list(self.notes)
        data["versions"] = dict(self.versions)
        return data

    def to_json(self) -> str:
        """The report as indented JSON."""
        return json.dumps(self.to_dict(), indent=2)

    def to_text(self) -> str:
        """The report for people: one block per section, aligned, figures in binary units."""
        title = f"VRAM Report - {self.label}" if self.label else "VRAM Report"
        lines = [f"{title} ({self.created})", "", "Devices:", *_or_none([_device_line(d) for d in self.devices])]
        lines += [f"  ! {error}" for error in self.errors]
        host = self.host
        lines += [
            "",
            f"RAM: {format_bytes(host.used)} used of {format_bytes(host.total)}, "
            f"{format_bytes(host.available)} available; this process (RSS): {format_bytes(host.process_rss)}",
        ]
        if self.mode is not None:
            lines += ["", *_mode_lines(self.mode)]
        if self.subject is not None:
            lines += ["", "Input at this point:", _model_line(self.subject)]
        lines += [
            "",
            f"Models loaded by ComfyUI ({len(self.models)}):",
            *_or_none([_model_line(m) for m in self.models]),
        ]
        if self.notes:
            lines += ["", "Notes:"] + [f"  - {note}" for note in self.notes]
        return "\n".join(lines)


def _or_none(lines: list[str]) -> list[str]:
    return lines or ["  (none)"]


def _mode_lines(mode: MemoryMode) -> list[str]:
    lines = [
        f"Memory mode: {mode.vram_state} - {mode.description}",
        f"  compute device: {mode.compute_device}; smart memory: {'on' if mode.smart_memory else 'off'}; "
        f"dynamic VRAM: {mode.dynamic_vram}",
    ]
    if mode.pinned_cap is not None or mode.pinned_bytes:
        lines.append(f"  pinned host memory: {pinned_text(mode)}")
    return lines


def pinned_text(mode: MemoryMode) -> str:
    """Who holds page-locked host memory, against which caps: ``ComfyUI 1.20 GiB (its cap 9.60 GiB), Device
    Control 3.40 GiB; one cap for both: 10.8 GiB``."""
    comfy = "ComfyUI " + ("not reported" if mode.pinned_bytes is None else format_bytes(mode.pinned_bytes))
    if mode.comfy_pinned_cap == 0:
        comfy += " (it pins none)"
    elif mode.comfy_pinned_cap is not None:
        comfy += f" (its cap {format_bytes(mode.comfy_pinned_cap)})"
    text = f"{comfy}, Device Control {format_bytes(mode.pack_pinned_bytes or 0)}"
    return text if mode.pinned_cap is None else f"{text}; one cap for both: {format_bytes(mode.pinned_cap)}"


def _shallow(record: Any) -> dict[str, Any]:
    """A flat record's fields as a dict, tuples as lists (``asdict`` deep-copies, which the panel's
    many-times-a-second snapshot cannot afford)."""
    return {
        f.name: list(value) if isinstance(value := getattr(record, f.name), tuple) else value for f in fields(record)
    }


def _model_dict(model: ModelResidency) -> dict[str, Any]:
    return {**_shallow(model), "resident": dict(model.resident)}


def _device_line(device: DeviceInfo) -> str:
    head = f"  {device.id or device.native:<6} {device.name} [{device.kind}]"
    if device.error:
        return f"{head}: query failed: {device.error}"
    if device.total is None:
        return f"{head}: memory not reported by this backend"
    parts = [f"{format_bytes(device.used)} used of {format_bytes(device.total)}", f"{format_bytes(device.free)} free"]
    if device.torch_allocated is not None:
        allocated, reserved = format_bytes(device.torch_allocated), format_bytes(device.torch_reserved)
        parts.append(f"torch allocated {allocated} / reserved {reserved}")
    if device.peak_allocated is not None:
        parts.append(_peak_part(device))
    if device.used_by_others:
        parts.append(f"other processes {format_bytes(device.used_by_others)}")
    if device.utilization is not None:
        parts.append(f"busy {device.utilization}%")
    if device.temperature is not None:
        parts.append(f"{device.temperature} °C")
    if device.is_accelerator:
        parts.append(f"computes in {'/'.join(device.dtypes)}")
    return f"{head}: " + "; ".join(parts)


def _peak_part(device: DeviceInfo) -> str:
    """The device's peak since the previous report; one that is only a lower bound says so, and how to get it
    exact."""
    figure = format_bytes(device.peak_allocated)
    if not device.peak_bounded:
        return f"peak since the previous report {figure}"
    return f"peak since the previous report ≥ {figure} (not a new high; {PEAKS_ENV}=reset for exact peaks)"


def _model_line(model: ModelResidency) -> str:
    where = ", ".join(f"{format_bytes(size)} on {device}" for device, size in model.resident if size)
    state = "partial" if model.partial else "full"
    extras = [f"computes on {model.compute_device}", state]
    if model.dtype:
        extras.append(model.dtype)
    extras.append(f"managed by {model.managed_by}")
    if model.budget is not None:
        extras.append(f"budget {model.budget}")
    if model.kept:
        extras.append("kept resident")
    if not model.in_use:
        extras.append("idle")
    head = f"  {model.component:<5} {model.name} ({model.model_class}), {format_bytes(model.total_bytes)}"
    line = f"{head}: {where or 'nothing resident'} [{', '.join(extras)}]"
    return line + (f"\n        {model.note}" if model.note else "")


def build_report(
    snapshot: InventorySnapshot,
    models: list[ModelResidency],
    mode: MemoryMode | None,
    *,
    subject: ModelResidency | None = None,
    label: str = "",
    notes: list[str] | None = None,
    versions: dict[str, str] | None = None,
) -> MemoryReport:
    """Assemble a report from an inventory snapshot and the models the host application has loaded."""
    base_versions = {"python": platform.python_version(), "torch": torch.__version__}
    return MemoryReport(
        label=label,
        devices=snapshot.devices,
        errors=tuple(snapshot.errors),
        host=snapshot.host,
        models=tuple(models),
        mode=mode,
        subject=subject,
        notes=(*snapshot.notes, *(notes or ())),
        versions={**base_versions, **(versions or {})},
    )
