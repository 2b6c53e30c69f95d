"""Benchmarks, side by side with ComfyUI 0.3.75 in one run; prints Markdown tables (README carries the latest).

    python3 tools/bench.py                # every benchmark
    python3 tools/bench.py --only ops     # one section: loader, detection, ops, patching, policy, panel, soak

Every measurement runs in a fresh process (``tools/bench_workers.py``). Figures are ratios to ComfyUI's, taken
on the same machine in the same run; absolute seconds drift 3-4x between runs on shared machines.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from any folder

from tools.runtime import REPO, fixtures_dir, provision, venv_python

log = logging.getLogger("device_control.tools")
GiB = 1024**3
SD15 = "SD1.5 (synthetic, 2.0 GiB fp16)"
SDXL = "SDXL base checkpoint (sparse)"
# label -> (name in the layouts, file name): real layouts, weights left as a hole (no disk, reads as zeros)
SPARSE = {
    SDXL: ("sdxl_base.checkpoint.json", "bench_sdxl_base_sparse.safetensors"),
    "Flux.1 dev checkpoint (sparse)": ("flux1_dev.checkpoint.json", "bench_flux1_dev_sparse.safetensors"),
    "Wan 2.1 T2V 14B diffusion model (sparse)": (
        "wan21_t2v_14b.diffusion_model.json",
        "bench_wan21_14b_sparse.safetensors",
    ),
}


def _worker(*args: str, module: str = "tools.bench_workers") -> dict:
    done = subprocess.run(
        [str(venv_python()), "-m", module, *args], cwd=REPO, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"benchmark worker {args} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _files() -> dict[str, Path]:
    subprocess.run([str(venv_python()), "-m", "tools.make_fixtures"], cwd=REPO, check=True, capture_output=True)
    code = (
        "import sys, tools.layouts as l; from pathlib import Path\n"
        "for name, out in zip(sys.argv[1::2], sys.argv[2::2]):\n"
        "    p = Path(out)\n"
        "    p.exists() or l.write_sparse_safetensors(l.layouts()[name], p)\n"
    )
    bench = fixtures_dir() / "bench"
    bench.mkdir(parents=True, exist_ok=True)
    args = [item for name, out in SPARSE.values() for item in (name, str(bench / out))]
    subprocess.run([str(venv_python()), "-c", code, *args], cwd=REPO, check=True)
    files = {SD15: fixtures_dir() / "checkpoints" / "device_control_sd15_synthetic.safetensors"}
    files |= {label: bench / out for label, (_name, out) in SPARSE.items()}
    return files


def _gib(value: float) -> str:
    return f"{value / GiB:.2f} GiB"


def bench_loader(files: dict[str, Path]) -> str:
    rows = [
        "| checkpoint (loaded to CPU, default dtypes) | loader | time | ratio | peak RSS above baseline "
        "| resident | peak / resident |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    cases = [
        (SD15, files[SD15]),
        ("SDXL (sparse, 6.5 GiB fp16)", files[SDXL]),
    ]
    for label, path in cases:
        results = {who: _worker("load", who, str(path)) for who in ("comfyui", "ours")}
        for who in ("comfyui", "ours"):
            r = results[who]
            extra = r["peak"] - r["baseline"]
            ratio = r["seconds"] / results["comfyui"]["seconds"]
            rows.append(
                f"| {label} | {'ComfyUI 0.3.75' if who == 'comfyui' else 'Device Control'} "
                f"| {r['seconds']:.1f} s | {ratio:.2f}x | {_gib(extra)} | {_gib(r['resident'])} "
                f"| {extra / r['resident']:.2f} |"
            )
    return "\n".join(rows)


def bench_detection(files: dict[str, Path]) -> str:
    rows = [
        "| file | size | Device Control (header only) | ComfyUI 0.3.75 (state dict + detection) | class |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, path in files.items():
        ours = _worker("detect", "ours", str(path), "7")
        size = path.stat().st_size
        theirs = _worker("detect", "comfyui", str(path), "3") if size < 8 * GiB else None
        comfy = f"{theirs['median'] * 1000:.0f} ms" if theirs else "not run (larger than this machine's RAM allows)"
        rows.append(f"| {label} | {_gib(size)} | {ours['median'] * 1000:.1f} ms | {comfy} | {ours['found']} |")
    return "\n".join(rows)


def bench_ops(_files: dict[str, Path]) -> str:
    results = _worker("ops")
    columns = ["plain fp32", "ours, no cast", "ComfyUI float16", "ours float16", "ComfyUI bfloat16", "ours bfloat16"]
    rows = [
        "| layer (CPU, fp32 input) | " + " | ".join(columns) + " | ours / ComfyUI fp16 | ours / ComfyUI bf16 "
        "| no cast / plain |",
        "| --- |" + " --- |" * (len(columns) + 3),
    ]
    for label, r in results.items():
        cells = " | ".join(f"{r[c]:.2f} ms" for c in columns)
        rows.append(
            f"| {label} | {cells} | {r['ours float16'] / r['ComfyUI float16']:.2f}x "
            f"| {r['ours bfloat16'] / r['ComfyUI bfloat16']:.2f}x | {r['ours, no cast'] / r['plain fp32']:.2f}x |"
        )
    return "\n".join(rows)


def bench_patching(files: dict[str, Path]) -> str:
    checkpoint = files[SD15]
    lora = fixtures_dir() / "bench" / "bench_sd15_lora_r32.safetensors"
    code = (
        "import sys, tools.make_fixtures as m, tools.comfy_inprocess as c; from pathlib import Path\n"
        "c.import_comfy(); m.make_sd15_lora(Path(sys.argv[1]), rank=32)"
    )
    subprocess.run([str(venv_python()), "-c", code, str(lora)], cwd=REPO, check=True, capture_output=True)
    results = _worker("patch", str(checkpoint), str(lora))
    base = results["ComfyUI 0.3.75"]["ms"]
    rows = [
        "| rank-32 LoRA on the SD1.5 UNet (fp16, CPU) | patch + restore | ratio | layers | restore bit-exact |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, r in results.items():
        rows.append(f"| {label} | {r['ms']:.0f} ms | {r['ms'] / base:.2f}x | {r['layers']} | {r['exact']} |")
    return "\n".join(rows)


def bench_policy(files: dict[str, Path]) -> str:
    results = _worker("policy", str(files[SD15]))
    rows = [
        "| budget (of the 1.6 GiB fp16 UNet) | policy | resident | streamed per step | streamed layers "
        "| casting room | step (simulated GPU) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, r in results.items():
        policy, share = key.split("|")
        rows.append(
            f"| {float(share):.0%} | {policy} | {_gib(r['resident'])} | {_gib(r['total'] - r['resident'])} "
            f"| {r['streamed_layers']} | {r['reserve'] / 1024**2:.0f} MiB | {r['ms']:.0f} ms |"
        )
    return "\n".join(rows)


def bench_panel(_files: dict[str, Path]) -> str:
    r = _worker(module="tools.bench_panel")
    latency, push, flow = r["latency"], r["push"], r["workflow"]
    rows = [
        "| measured with the example workflow's models loaded | Device Control | ComfyUI |",
        "| --- | --- | --- |",
    ]
    for when, figures in (("idle", r["idle_latency"]), ("while sampling", latency)):
        ours, theirs = figures["snapshot"], figures["system_stats"]
        for what, key in (("median", "median_ms"), ("p99", "p99_ms"), ("max", "max_ms")):
            rows.append(f"| GET latency {when}, {what} of 1,000 | {ours[key]:.2f} ms | {theirs[key]:.2f} ms |")
        made = figures["snapshot_made"]
        rows.append(
            f"| snapshot made on the server {when}, median / p99 | {made['median_ms']:.2f} / {made['p99_ms']:.2f} ms "
            "| - |"
        )
    rows += [
        f"| push thread CPU at 1 s | {push['cpu_share']:.2%} of one core ({push['ms_per_push']:.1f} ms per "
        f"push, {push['received']} of {push['pushes']} received) | - |",
        f"| workflow time, panel open / closed (median of {len(flow['open_all'])}) | {flow['open_s']:.2f} s / "
        f"{flow['closed_s']:.2f} s ({flow['open_s'] / flow['closed_s'] - 1:+.1%}; runs vary by "
        f"{flow['spread']:.1%}) | - |",
    ]
    load = r["load"]
    rows.append(
        f"| {load['requests']:,} snapshot GETs (4 concurrent clients) with {load['clients']} websocket clients "
        f"listening, while sampling: median / p99 / max | {load['median_ms']:.1f} / {load['p99_ms']:.1f} / "
        f"{load['max_ms']:.0f} ms; {len(load['errors'])} errors; every client got >= {load['pushes_min']} pushes; "
        f"{load['workflow_runs']} runs, {len(load['workflow_failures'])} failed | - |"
    )
    return "\n".join(rows) + "\n\nComfyUI column: its own `GET /system_stats`, interleaved with ours on one connection."


def bench_soak(_files: dict[str, Path]) -> str:
    r = _worker(module="tools.bench_soak")
    cycles, warmup = r["cycles"], r["warmup"]
    return "\n".join(
        [
            "| long soak: load, Move To GPU (2 GB budget), sample, Offload To CPU, decode | Device Control |",
            "| --- | --- |",
            f"| cycles (one prompt each, the checkpoint loaded from disk each time) | {cycles} |",
            f"| median cycle | {r['median_cycle_s']:.1f} s |",
            f"| simulated GPU after each offload (bytes held, every cycle) | {r['gpu_after_offload']} |",
            f"| RSS after cycle {warmup} (baseline) / after cycle {cycles} | {r['baseline_rss'] / GiB:.2f} GiB / "
            f"{r['final_rss'] / GiB:.2f} GiB |",
            f"| drift / highest RSS after the baseline | {r['drift'] / 1024**2:+.0f} MiB "
            f"({r['drift'] / r['baseline_rss']:+.2%}) / {r['max_rss'] / GiB:.2f} GiB |",
        ]
    )


SECTIONS = {
    "loader": bench_loader,
    "detection": bench_detection,
    "ops": bench_ops,
    "patching": bench_patching,
    "policy": bench_policy,
    "panel": bench_panel,
    "soak": bench_soak,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append", help="run only these sections")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    provision()
    files = _files()
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    log.info("Machine: %s", machine)
    for name in args.only or list(SECTIONS):
        log.info("\n### %s\n\n%s", name, SECTIONS[name](files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
