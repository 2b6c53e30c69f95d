"""VRAM Report: memory per device, RAM, and every loaded model, at the point in the graph where it sits."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from ..core.errors import DeviceControlError
from ..core.monitor.report import MemoryReport, build_report
from . import bridge
from .state import inventory
from .surface import comfyui_version, io

log = logging.getLogger("device_control")

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


def profile_so_far() -> str:
    """The run's heaviest node so far, from the memory profile (or why there is none)."""
    from .profiling import PROFILE_ENV, recorder, recording

    if not recording():
        return f"profile: off ({PROFILE_ENV}=off)"
    latest = recorder.latest()
    return "profile: no prompt recorded yet" if latest is None else latest.summary()


class VRAMReport(io.ComfyNode):
    """Thin node: everything it shows comes from ``make_report``."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        device_ids = [d.id for d in inventory.snapshot().devices if d.id]
        return io.Schema(
            node_id="DeviceControl_VRAMReport",
            display_name="VRAM Report",
            category="Device Control",
            description=(
                "Shows memory per device (total, free, used by this process and by others), RAM, and every "
                "model ComfyUI has loaded with how much of it is resident where. Put it on any wire: it "
                "passes the value through and reports at that moment of the run."
            ),
            inputs=[
                io.AnyType.Input(
                    "value",
                    optional=True,
                    tooltip=(
                        "Any value (MODEL, CLIP, VAE, LATENT, IMAGE...). It is passed through unchanged; connecting it "
                        "makes the report run after the node that produced it. A MODEL, CLIP or VAE is also described."
                    ),
                ),
                io.String.Input(
                    "label",
                    default="",
                    tooltip=("A name for this report, such as 'after sampling', shown in its first line."),
                ),
                io.Combo.Input(
                    "devices",
                    options=[ALL_DEVICES, *device_ids],
                    default=ALL_DEVICES,
                    tooltip=(
                        "Which devices to show: 'all', or one device (cpu, gpu:0, ...). A device this machine does not "
                        "have is reported in the text, and all devices are shown."
                    ),
                ),
                io.Boolean.Input(
                    "profile",
                    default=False,
                    optional=True,
                    tooltip=(
                        "End the report with the run's memory profile so far: the node that used the most memory "
                        "before this one, how much and where."
                    ),
                ),
            ],
            outputs=[
                io.AnyType.Output("passthrough", display_name="value", tooltip="The input value, unchanged."),
                io.String.Output("report", display_name="report", tooltip="The report as text."),
                io.String.Output(
                    "report_json",
                    display_name="report_json",
                    tooltip="The report as JSON, for bug reports and scripts.",
                ),
            ],
            hidden=[io.Hidden.unique_id],
            is_output_node=True,
            not_idempotent=True,
        )

    @classmethod
    def validate_inputs(cls, devices: str) -> bool:
        # Any device string is accepted here: one this machine lacks is reported in the text at run time,
        # so a workflow saved on another machine still runs.
        return True

    @classmethod
    def fingerprint_inputs(cls, **kwargs: Any) -> float | bool:
        # Wired after a node (``value`` linked: None here), the report says what that point of the graph left, and
        # is cached with it as any node is: an unchanged prompt queued again runs nothing. With nothing connected
        # it reports memory now: NaN, never equal to itself, makes it run on every queue.
        return False if "value" in kwargs else float("nan")

    @classmethod
    def execute(
        cls, label: str = "", devices: str = ALL_DEVICES, value: Any = None, profile: bool = False
    ) -> io.NodeOutput:
        report = make_report(value, label, devices)
        # The next report's peaks are those since this one (a sampler's, say); the counters are reset only under
        # DEVICE_CONTROL_PEAKS=reset.
        inventory.reset_peaks()
        text, as_json = report.to_text(), report.to_json()
        if profile:
            text += "\n" + profile_so_far()
        log.info("[Device Control] VRAM Report (node %s)\n%s", cls.hidden.unique_id if cls.hidden else "?", text)
        return io.NodeOutput(value, text, as_json, ui={"text": (text,), "device_control_report": (as_json,)})
