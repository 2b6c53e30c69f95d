"""What to expect without a GPU: one SD1.5 sampling step at 512x512 on the CPU, stock loader against ours.

    python3 tools/bench/cpu_step.py            # 3 runs per side; prints a Markdown table and one JSON line
    python3 tools/bench/cpu_step.py --runs 5

An SD1.5 checkpoint's compute does not depend on its weights' values, so the synthetic checkpoint (full size, random
weights) costs what the released one costs. One ComfyUI server (CPU mode, no simulated GPU) runs the same graph
with ComfyUI's Load Checkpoint and with Load Checkpoint With Device (every part on ``cpu``), alternating so that
drift hits both. The model and the prompts' encodings stay cached; a prompt with 2 steps and one with 1 step differ
only by the sampler's steps, so their wall times' difference is one step (cfg 7: two UNet passes a step).
A cell is the median of the runs with their minimum and maximum.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.runtime.provision import PRIMARY_VERSION, REPO, provision
from tools.runtime.server import ComfyServer

#: The synthetic SD1.5 checkpoint ``tools.fixtures.make`` writes (its name there; that module needs torch).
SD15_CHECKPOINT = "device_control_sd15_synthetic.safetensors"

SIZE, FEW, MORE = 512, 1, 2
LOADERS = {
    "ComfyUI's Load Checkpoint": ("CheckpointLoaderSimple", {"ckpt_name": SD15_CHECKPOINT}),
    "Load Checkpoint With Device (cpu)": (
        "DeviceControl_LoadCheckpoint",
        {
            "ckpt_name": SD15_CHECKPOINT,
            "model_device": "cpu",
            "clip_device": "cpu",
            "vae_device": "cpu",
            "model_dtype": "auto",
            "clip_dtype": "auto",
            "vae_dtype": "auto",
        },
    ),
}


def prompt(loader: str, steps: int) -> dict[str, Any]:
    """Text to image at 512x512, cfg 7, euler, with ``loader`` (a key of :data:`LOADERS`)."""
    kind, inputs = LOADERS[loader]
    return {
        "1": {"class_type": kind, "inputs": inputs},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a lighthouse on a cliff", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["1", 1]}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
        "5": {
            "class_type": "KSampler",
            "inputs": {
                "model": ["1", 0],
                "positive": ["2", 0],
                "negative": ["3", 0],
                "latent_image": ["4", 0],
                "seed": 1,
                "steps": steps,
                "cfg": 7.0,
                "sampler_name": "euler",
                "scheduler": "normal",
                "denoise": 1.0,
            },
        },
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
        "7": {"class_type": "PreviewImage", "inputs": {"images": ["6", 0]}},
    }


def timed(server: ComfyServer, body: dict[str, Any]) -> float:
    started = time.perf_counter()
    server.run(body, timeout=1800)
    return time.perf_counter() - started


def one_step(server: ComfyServer, loader: str) -> float:
    """Seconds of one sampling step with ``loader``'s model (its load and encodings cached by a warm-up)."""
    server.run(prompt(loader, FEW), timeout=1800)  # loads the model (the other loader's replaced it), encodes
    few = timed(server, prompt(loader, FEW))
    more = timed(server, prompt(loader, MORE))
    return (more - few) / (MORE - FEW)


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} s ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per loader (default 3)")
    args = parser.parse_args()
    python = provision(PRIMARY_VERSION)
    subprocess.run([str(python), "-m", "tools.fixtures.make", "--without-families"], cwd=REPO, check=True)
    steps: dict[str, list[float]] = {name: [] for name in LOADERS}
    with tempfile.TemporaryDirectory() as base, ComfyServer(Path(base)) as server:
        for _ in range(args.runs):
            for name in LOADERS:
                steps[name].append(one_step(server, name))
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    machine = f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, ComfyUI {PRIMARY_VERSION}, load {load}"
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"One SD1.5 step at {SIZE}x{SIZE}, cfg 7, on the CPU ({machine}, {date}; median of {args.runs} runs, min-max)",
        "",
        "| loader | one step |",
        "| --- | --- |",
        *(f"| {name} | {cell(values)} |" for name, values in steps.items()),
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.write(json.dumps({"date": date, "machine": machine, "size": SIZE, "steps": steps}) + "\n")


if __name__ == "__main__":
    main()
