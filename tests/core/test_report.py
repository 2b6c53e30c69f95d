"""The memory report: text for people, JSON for bug reports, and no crash on unknown figures."""

from __future__ import annotations

import dataclasses
import json

import torch

from core.devices.backends import CpuBackend, DeviceBackend, DeviceInfo, simulated_backends
from core.devices.inventory import DeviceInventory
from core.devices.sim.device import SimulatedDevice
from core.monitor.report import MemoryMode, ModelResidency, build_report

GiB = 1024**3


class NoMemoryBackend(DeviceBackend):
    """A backend that cannot report memory, as DirectML cannot."""

    name = "directml"

    def available(self):
        return True

    def devices(self):
        return [DeviceInfo("", "directml", "Radeon Test", "privateuseone:0", None, None)]


def make_snapshot():
    inventory = DeviceInventory(
        backends=[NoMemoryBackend(), CpuBackend()],
        extra=simulated_backends([SimulatedDevice(8 * GiB), SimulatedDevice(GiB, ordinal=1, faults={"stats"})]),
    )
    return inventory.snapshot()


UNET = ModelResidency(
    name="SD15 diffusion model",
    component="MODEL",
    model_class="BaseModel",
    total_bytes=3 * GiB,
    resident=(("gpu:1", 2 * GiB), ("cpu", GiB)),
    compute_device="gpu:1",
    partial=True,
    dtype="float16",
    managed_by="Device Control",
    in_use=False,
)
MODE = MemoryMode(
    "NORMAL_VRAM",
    "normal",
    "GPU",
    "gpu:0",
    True,
    "not available in this ComfyUI",
    512 * 1024**2,
    comfy_pinned_cap=8 * 1024**3,
    pack_pinned_bytes=1024**3,
    pinned_cap=9 * 1024**3,
)


def test_text_report_has_every_section_and_figure():
    report = build_report(make_snapshot(), [UNET], MODE, label="after sampling", notes=["something to know"])
    text = report.to_text()
    assert text.startswith("VRAM Report - after sampling (")
    assert "gpu:0  Radeon Test [directml]: memory not reported by this backend" in text
    assert "gpu:1  Simulated GPU 0 (8.00 GiB) [simulated]: 0 B used of 8.00 GiB; 8.00 GiB free" in text
    assert "gpu:2  Simulated GPU 1 (1.00 GiB) [simulated]: query failed: RuntimeError: sim:1: injected fault" in text
    assert "RAM: " in text and "this process (RSS): " in text
    assert "Memory mode: NORMAL_VRAM - normal" in text and (
        "pinned host memory: ComfyUI 512.00 MiB (its cap 8.00 GiB), Device Control 1.00 GiB; one cap for both: "
        "9.00 GiB" in text
    )
    assert (
        "MODEL SD15 diffusion model (BaseModel), 3.00 GiB: 2.00 GiB on gpu:1, 1.00 GiB on cpu "
        "[computes on gpu:1, partial, float16, managed by Device Control, idle]" in text
    )
    assert "Notes:\n  - something to know" in text


def test_a_device_s_peak_since_the_previous_report_is_shown_and_restarted_by_the_inventory():
    sim = SimulatedDevice(8 * GiB)
    inventory = DeviceInventory(backends=[CpuBackend()], extra=simulated_backends([sim]), peak_mode="keep")
    kept = sim.place(torch.zeros(256, 1024))  # 1 MiB that stays
    scratch = sim.place(torch.zeros(1024, 1024))  # 4 MiB, gone before the report: the peak remembers it
    del scratch
    text = build_report(inventory.snapshot(), [], MODE).to_text()
    assert "peak since the previous report 5.00 MiB;" in text
    inventory.reset_peaks()  # the VRAM Report node does this after each report; the counter is not reset
    assert sim.peak_allocated() == 5 * 1024**2
    report = build_report(inventory.snapshot(), [], MODE)  # no new high since: at least what it holds
    assert "peak since the previous report ≥ 1.00 MiB (not a new high; DEVICE_CONTROL_PEAKS=reset" in report.to_text()
    device = next(d for d in report.to_dict()["devices"] if d["id"] == "gpu:0")
    assert (device["peak_allocated"], device["peak_bounded"]) == (sim.allocated(), True) == (1024**2, True)
    del kept


def test_reset_mode_resets_the_counter_after_each_report_for_exact_peaks():
    sim = SimulatedDevice(8 * GiB)
    inventory = DeviceInventory(backends=[CpuBackend()], extra=simulated_backends([sim]), peak_mode="reset")
    kept = sim.place(torch.zeros(256, 1024))
    scratch = sim.place(torch.zeros(1024, 1024))
    del scratch
    inventory.reset_peaks()
    info = inventory.snapshot().get("gpu:0")
    assert (info.peak_allocated, info.peak_bounded) == (sim.peak_allocated(), False) == (1024**2, False)
    del kept


def test_a_placement_not_in_force_is_said_on_a_line_of_its_own():
    pending = dataclasses.replace(UNET, managed_by="ComfyUI", note="placed by Device Control (gpu:0, budget 1.00 GiB)")
    text = build_report(make_snapshot(), [pending], MODE).to_text()
    assert "managed by ComfyUI, idle]\n        placed by Device Control (gpu:0, budget 1.00 GiB)" in text


def test_json_report_keeps_exact_bytes():
    report = build_report(make_snapshot(), [UNET], MODE, subject=UNET)
    data = json.loads(report.to_json())
    assert data["models"][0]["resident"] == {"gpu:1": 2 * GiB, "cpu": GiB}
    assert data["subject"]["total_bytes"] == 3 * GiB
    sim = next(d for d in data["devices"] if d["id"] == "gpu:1")
    assert (sim["total"], sim["free"], sim["used"]) == (8 * GiB, 8 * GiB, 0)
    assert data["host"]["process_rss"] > 0
    assert {"python", "torch"} <= set(data["versions"])
    assert any("injected fault" in e for e in data["errors"])


def test_empty_report_still_renders():
    report = build_report(make_snapshot(), [], None)
    text = report.to_text()
    assert "Models loaded by ComfyUI (0):\n  (none)" in text
    assert "Memory mode" not in text
