"""The GPU benchmark runs end to end without a GPU, so that its one short run on a lent GPU does not find its bugs.

On the pack's simulated GPU (``--simulate``), at 64² and one step a run, ``tools/gpu/bench.py`` makes (here: finds)
its fixture in its second process, loads the synthetic SD1.5 with ComfyUI's own loader, samples it with ComfyUI
(on the CPU: it cannot drive a simulated GPU), with Move To GPU under a budget on a card held small (prefetch on and
off) and with everything resident, decodes and compares the images, and writes the table and the raw JSON with
every figure the GPU run reports. The benchmark's own code is the same on a GPU; only the card differs
(``tools/gpu/card.py``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.passes import ONCE
from tools.gpu.report import COLUMNS
from tools.runtime.provision import REPO

GiB = 1024**3
RUNS = [
    ("ComfyUI, fully resident", "whole card"),
    ("ComfyUI on the CPU", "2.3 GiB free"),
    ("ours 1GB, prefetch on", "2.3 GiB free"),
    ("ours 1GB, prefetch off", "2.3 GiB free"),
    ("ours all, prefetch on", "whole card"),
    ("ours all, prefetch off", "whole card"),
]


@pytest.mark.slow
@ONCE
def test_the_gpu_benchmark_runs_end_to_end_on_a_simulated_gpu_and_reports_every_figure(
    comfy_runtime, synthetic_models, tmp_path
):
    fixtures = synthetic_models["checkpoint"].parent.parent
    command = [sys.executable, "tools/gpu/bench.py", "--simulate", "--comfyui-dir", str(comfy_runtime)]
    command += ["--fixtures", str(fixtures), "--out", str(tmp_path), "--budgets", "1GB", "--warm-up", "0", "--profile"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-6000:]

    raw = json.loads((tmp_path / "bench_gpu_simulated.json").read_text())
    assert raw["mode"] == "simulated" and raw["errors"] == {}
    assert raw["machine"]["comfyui"] == comfy_runtime.name.removeprefix("comfyui-")
    assert raw["bandwidth"]["pinned"] > 0 and raw["fixtures"]["sd15_checkpoint"]["path"].endswith(".safetensors")
    case = raw["cases"]["sd15"]
    rows = case["rows"]
    assert [(row["run"], row["card"]) for row in rows] == RUNS
    assert all("error" not in row and row["step_ms"] > 0 and len(row["steps_ms_host"]) == 1 for row in rows), rows
    total, compute = case["total_bytes"], case["compute_ms"]
    assert total > GiB and compute == min(row["step_ms"] for row in rows if row["card"] == "whole card")

    for row in rows[2:]:  # ours, on the simulated GPU: resident bytes, what crosses each step, the floor
        assert row["allocated_bytes"] >= row["resident_bytes"]
        assert row["streamed_bytes"] == total - row["resident_bytes"]
        assert row["floor_ms"] == max(compute, row["transfer_ms"]) and row["step_over_floor"] > 0
        assert row["passes_per_step"] == 1  # cfg 1: the sampler runs the model once a step
        assert row["transfer_ms"] == row["streamed_bytes"] / raw["bandwidth"]["pinned"] * 1000
        assert row["peak_bytes"] >= row["resident_bytes"] and row["left_allocated"] == 0
        assert "resident on gpu:0" in row["summary"] and row["prefetch_switched"]
    assert all(0 < row["resident_bytes"] <= GiB for row in rows[2:4])
    assert all(row["resident_bytes"] == total and row["streamed_bytes"] == 0 for row in rows[4:])
    # Every image is compared with ComfyUI's fully resident one; ComfyUI's second run computes the same thing.
    assert all(0 <= row["image_diff_255"] <= 255 and row["latent_max_diff"] >= 0 for row in rows)
    assert rows[1]["image_diff_255"] == 0 and rows[1]["latent_max_diff"] == 0

    # The profiled run (not in the table): where the host's time went.
    profile = (tmp_path / "profile_sd15.txt").read_text()
    assert "under cProfile" in profile and "function calls" in profile

    table = (tmp_path / "bench_gpu_simulated.md").read_text()
    assert "| " + " | ".join(COLUMNS) + " |" in table and table.strip() in done.stdout
    assert [line.split(" | ")[1] for line in table.splitlines() if line.startswith("| SD1.5")] == [r for r, _ in RUNS]
