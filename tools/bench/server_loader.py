"""A ComfyUI server's memory while a checkpoint loads to the CPU: ComfyUI's Load Checkpoint against Load Checkpoint
With Device (every part on ``cpu``), each in a fresh server, on the same file, in one run; prints a Markdown table.

    .runtime/venv/bin/python -m tools.bench.server_loader [--runs 3] [--raw FILE]
    DEVICE_CONTROL_COMFYUI=0.33.0 .runtime/venv/bin/python -m tools.bench.server_loader   # another ComfyUI

A user saw ComfyUI's resident set peak at 6.6 GB while the 2.1 GB starter checkpoint loaded with every part on the
CPU, then settle at 5.0 GB. This measures both loaders where the user saw it, in the server: each run starts a fresh
ComfyUI (``--cpu``), runs a VRAM Report alone (the executor's and the pack's first-prompt imports), reads the
server's resident set (the baseline) and resets its high-water mark (``/proc/<pid>/clear_refs``, Linux only), then
queues the loader with a VRAM Report on its MODEL. The peak is the high-water mark after that prompt, the settled
figure the resident set after it, both above the baseline. The loaders alternate, the order swapped every round;
the file is read once before the runs, so both find it in the page cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from any folder

from tools.fixtures.make import SD15_CHECKPOINT
from tools.runtime.provision import DEFAULT_VERSION, fixtures_dir
from tools.runtime.server import ComfyServer

GiB = 1024**3
#: The loaders compared, by the name the table gives them: the nodes that load the checkpoint to the CPU.
LOADERS: dict[str, dict[str, Any]] = {
    "ComfyUI's Load Checkpoint": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": SD15_CHECKPOINT}},
    "Load Checkpoint With Device, every part on cpu": {
        "class_type": "DeviceControl_LoadCheckpoint",
        "inputs": {
            "ckpt_name": SD15_CHECKPOINT,
            **dict.fromkeys(("model_device", "clip_device", "vae_device"), "cpu"),
            **dict.fromkeys(("model_dtype", "clip_dtype", "vae_dtype"), "auto"),
        },
    },
}


def _report(value: list | None = None) -> dict[str, Any]:
    inputs: dict[str, Any] = {"label": "", "devices": "all"}
    if value is not None:
        inputs["value"] = value
    return {"class_type": "DeviceControl_VRAMReport", "inputs": inputs}


def _status(pid: int) -> dict[str, int]:
    """The process's resident set now and its high-water mark, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def one_load(base: Path, node: dict[str, Any]) -> dict[str, float]:
    """Load the checkpoint with ``node`` in a fresh server: its peak and settled resident set above the baseline."""
    server = ComfyServer(base, cpu=True).start()
    try:
        pid = server.process.pid
        server.run({"1": _report()})
        baseline = _status(pid)["VmRSS"]
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # the high-water mark starts again from the resident set
        server.run({"1": node, "2": _report(["1", 0])})
        after = _status(pid)
        return {"peak": (after["VmHWM"] - baseline) / GiB, "settled": (after["VmRSS"] - baseline) / GiB}
    finally:
        server.stop()


def measure(runs: int) -> dict[str, list[dict[str, float]]]:
    """``runs`` loads with each loader, alternating, the order swapped every round."""
    (fixtures_dir() / "checkpoints" / SD15_CHECKPOINT).read_bytes()  # into the page cache, for both
    results: dict[str, list[dict[str, float]]] = {name: [] for name in LOADERS}
    names = list(LOADERS)
    for index in range(runs):
        for name in names if index % 2 == 0 else names[::-1]:
            with tempfile.TemporaryDirectory() as base:
                results[name].append(one_load(Path(base), LOADERS[name]))
    return results


def table(results: dict[str, list[dict[str, float]]]) -> str:
    """The Markdown table: the median of the runs with their range, and peak over settled."""

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} GiB ({min(values):.2f}-{max(values):.2f})"

    rows = [
        f"| loader ({SD15_CHECKPOINT}, 2.0 GiB fp16, ComfyUI {DEFAULT_VERSION} --cpu) | runs | peak above baseline "
        "| settled above baseline | peak / settled |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, runs in results.items():
        peaks, settled = [run["peak"] for run in runs], [run["settled"] for run in runs]
        ratio = statistics.median(peaks) / statistics.median(settled)
        rows.append(f"| {name} | {len(runs)} | {cell(peaks)} | {cell(settled)} | {ratio:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--raw", type=Path, default=None, help="where to write every run's figures (JSON)")
    args = parser.parse_args(argv)
    if not Path("/proc/self/clear_refs").exists():
        raise SystemExit("this benchmark reads and resets /proc/<pid>/status's high-water mark: Linux only")
    results = measure(args.runs)
    if args.raw is not None:
        args.raw.write_text(json.dumps(results, indent=2) + "\n")
    sys.stdout.write(table(results) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
