"""VRAM Report: memory per device, RAM, and every loaded model, at the point in the graph where it sits."""

from __future__ import annotations

import logging
from typing import Any

from . import profiling
from .memory_report import ALL_DEVICES, make_report
from .state import inventory
from .surface import io

log = logging.getLogger("device_control")


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
                        "makes the report run after the node that produced it. A model (MODEL, CLIP, VAE, CONTROL_NET, "
                        "CLIP_VISION, UPSCALE_MODEL, MODEL_PATCH, GLIGEN) is also described."
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
            text += "\n" + profiling.so_far()
        log.info("[Device Control] VRAM Report (node %s)\n%s", cls.hidden.unique_id if cls.hidden else "?", text)
        return io.NodeOutput(value, text, as_json, ui={"text": (text,), "device_control_report": (as_json,)})
