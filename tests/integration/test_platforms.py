"""The platforms users run, in a real ComfyUI: a streamed Move To GPU through Windows' surface (its ``mmap``, no
``/proc``, its driver's limit) gives stock ComfyUI's image; GPUs the driver has and ComfyUI does not see (ComfyUI on
Windows sets ``CUDA_VISIBLE_DEVICES=0`` unless started with ``--cuda-device all``) are named with the fix; ComfyUI's
pinned memory and ours are counted under one cap."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
LOW_VRAM = REPO / "workflows" / "04 SD1.5 and a LoRA under a 1.5 GB VRAM budget.json"
GiB = 1024**3


@pytest.fixture(scope="module")
def windows(servers):
    return servers("windows-8g", SIMULATE_GPU="8GiB", SIMULATE_PLATFORM="windows")


def test_a_streamed_move_through_windows_surface_gives_the_stock_image(windows, api):
    prompt = api.load_prompt(windows, LOW_VRAM)
    windows.forget_outputs()
    entry = windows.run(prompt)
    assert api.moves_hold(entry, prompt)
    moved = next(m for m in api.report_json(entry, "4")["models"] if m["component"] == "MODEL")
    assert moved["partial"] and moved["resident"]["gpu:0"] <= 1.5 * GiB < moved["total_bytes"]  # half of it streams
    assert np.array_equal(
        api.image_of(windows, entry), api.image_of(windows, windows.run(api.stock_equivalent(prompt)))
    )
    log = windows.log_path.read_text()
    assert "simulated platform windows" in log and "could not be page-locked" not in log


def test_the_panel_and_vram_report_count_comfyuis_pinned_memory_and_ours_under_one_cap(windows, api):
    text = api.report_text(windows.run(api.report_prompt(label="pinned")))
    assert "pinned host memory: ComfyUI " in text and "Device Control " in text and "one cap for both: " in text
    assert "page-locks at most about 50 % of RAM on this system (windows)" in text
    pinned = windows.get("/device_control/snapshot")["pinned"]
    assert 0 < pinned["cap"] <= 0.5 * windows.get("/system_stats")["system"]["ram_total"]


def test_gpus_comfyui_does_not_see_are_named_with_what_to_start_it_with(servers, api):
    server = servers("hidden-gpu", SIMULATE_GPU="8GiB,8GiB", env={"CUDA_VISIBLE_DEVICES": "0"})
    text = api.report_text(server.run(api.report_prompt(label="hidden")))
    assert "ComfyUI sees 1 of the 2 simulated GPUs the driver has (CUDA_VISIBLE_DEVICES=0 hides the others)" in text
    assert "--cuda-device all" in text and "gpu:1" not in text
    notes = server.get("/device_control/snapshot")["report"]["notes"]
    assert any("--cuda-device all" in note for note in notes)  # the panel shows the report's notes
    for node in ("DeviceControl_MoveToGPU", "DeviceControl_LoadCheckpoint"):  # the device lists say it too
        inputs = server.get(f"/object_info/{node}")[node]["input"]["required"]
        device = next(spec for name, spec in inputs.items() if name.endswith("device"))
        assert "gpu:1" not in json.dumps(device) and "--cuda-device all" in device[1]["tooltip"]
