"""The memory report our nodes and the panel read: every device, RAM, and every loaded model, with what one value
given (a model of any kind Move To GPU takes) holds where. VRAM Report shows it at its point in the graph; the
panel's snapshot and push carry it; neither needs the other to make it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..core.errors import DeviceControlError
from ..core.monitor.report import MemoryReport, build_report
from . import bridge
from .state import inventory
from .surface import comfyui_version

ALL_DEVICES = "all"


def make_report(value: Any = None, label: str = "", devices: str = ALL_DEVICES) -> MemoryReport:
    """Collect the report. Never raises for bad input: every problem becomes a note in the report."""
    snapshot = inventory.snapshot()
    notes: list[str] = []
    models, model_notes = bridge.loaded_models(snapshot)
    notes += model_notes + bridge.pinning_notes()
    try:
        mode = bridge.memory_mode(snapshot)
    except Exception as exc:  # an unreadable mode must not cost the rest of the report
        mode = None
        notes.append(f"could not read ComfyUI's memory mode: {type(exc).__name__}: {exc}")
    subject = None
    given = bridge.subject_of(value)
    if given is not None:
        try:
            subject = bridge.residency_of(given.patcher, snapshot)
        except Exception as exc:
            notes.append(f"could not describe the input: {type(exc).__name__}: {exc}")
    report = build_report(
        snapshot,
        models,
        mode,
        subject=subject,
        label=label.strip(),
        notes=notes,
        versions={"comfyui": comfyui_version()},
    )
    wanted = (devices or ALL_DEVICES).strip()
    if wanted.lower() != ALL_DEVICES:
        try:
            chosen = inventory.resolve(wanted, snapshot=snapshot).device
        except DeviceControlError as exc:
            return replace(report, notes=(*report.notes, f"{exc} Showing all devices."))
        return replace(report, devices=tuple(d for d in report.devices if d.id == chosen.id))
    return report
