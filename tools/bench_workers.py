"""Benchmark workers: each runs in a fresh runtime process and prints one JSON line of measurements.

    .runtime/venv/bin/python -m tools.bench_workers load comfyui|ours FILE
    .runtime/venv/bin/python -m tools.bench_workers detect comfyui|ours FILE [REPEATS]

Run by ``tools/bench.py``; a fresh process per measurement, so one load's memory cannot flatter another's.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from pathlib import Path

import psutil


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def _comfy(checkpoint_dir: Path) -> object:
    from tools.comfy_inprocess import import_comfy

    mm = import_comfy()
    import folder_paths

    folder_paths.add_model_folder_path("checkpoints", str(checkpoint_dir))
    return mm


def load(loader: str, path: Path) -> dict:
    """Load a checkpoint to the CPU with ComfyUI's loader or ours; time, memory and resident bytes."""
    mm = _comfy(path.parent)
    import comfy.sd  # in a running ComfyUI these are imported long before any load: keep imports out of the timing
    import comfy.supported_models

    if loader == "ours":
        from tools.comfy_inprocess import import_pack

        node = __import__(f"{import_pack().__name__}.nodes.load_checkpoint", fromlist=["x"])
    baseline = psutil.Process().memory_info().rss
    started = time.perf_counter()
    if loader == "ours":
        model, clip, vae, _ = node.LoadCheckpointWithDevice.execute(
            path.name, "cpu", "cpu", "cpu", "auto", "auto", "auto"
        ).args
    else:
        model, clip, vae, _ = comfy.sd.load_checkpoint_guess_config(str(path))
    seconds = time.perf_counter() - started
    resident = model.model_size() + clip.patcher.model_size() + vae.patcher.model_size()
    return {
        "seconds": seconds,
        "baseline": baseline,
        "peak": _peak_rss(),
        "resident": resident,
        "after": psutil.Process().memory_info().rss,
        "loaded_models": len(mm.current_loaded_models),
    }


def detect(detector: str, path: Path, repeats: int = 5) -> dict:
    """How long it takes to know what a file is: our header-only detection, or ComfyUI's (whole state dict)."""
    if detector == "ours":
        from core.detection import detect as ours

        def run() -> str:
            return ours(path).comfy_class
    else:
        _comfy(path.parent)
        import comfy.model_detection
        import comfy.utils

        def run() -> str:
            sd = comfy.utils.load_torch_file(str(path))
            prefix = comfy.model_detection.unet_prefix_from_state_dict(sd)
            return type(comfy.model_detection.model_config_from_unet(sd, prefix)).__name__

    times = []
    found = None
    for _ in range(repeats):
        started = time.perf_counter()
        found = run()
        times.append(time.perf_counter() - started)
    return {
        "median": statistics.median(times),
        "min": min(times),
        "found": found,
        "size": path.stat().st_size,
        "peak": _peak_rss(),
    }


def main() -> None:
    kind, who, path = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    result = load(who, path) if kind == "load" else detect(who, path, int(sys.argv[4]) if len(sys.argv) > 4 else 5)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
