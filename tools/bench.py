"""Benchmarks, side by side with ComfyUI 0.3.75 in one run; prints Markdown tables (README carries the latest).

    python3 tools/bench.py                # every benchmark
    python3 tools/bench.py --only loader  # one section: loader, detection

Every measurement runs in a fresh process (``tools/bench_workers.py``). Figures are ratios to ComfyUI's, taken
on the same machine in the same run; absolute seconds drift 3-4x between runs on shared machines.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from any folder

from tools.runtime import REPO, fixtures_dir, provision, venv_python

log = logging.getLogger("device_control.tools")
GiB = 1024**3
SPARSE = {  # name in the layouts -> file name: real layouts, weights left as a hole (no disk, reads as zeros)
    "sdxl_base.checkpoint.json": "bench_sdxl_base_sparse.safetensors",
    "flux1_dev.checkpoint.json": "bench_flux1_dev_sparse.safetensors",
    "wan21_t2v_14b.diffusion_model.json": "bench_wan21_14b_sparse.safetensors",
}


def _worker(*args: str) -> dict:
    done = subprocess.run(
        [str(venv_python()), "-m", "tools.bench_workers", *args], cwd=REPO, capture_output=True, text=True, check=False
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
    args = [item for name, out in SPARSE.items() for item in (name, str(bench / out))]
    subprocess.run([str(venv_python()), "-c", code, *args], cwd=REPO, check=True)
    files = {
        "SD1.5 (synthetic, 2.0 GiB fp16)": fixtures_dir() / "checkpoints" / "device_control_sd15_synthetic.safetensors"
    }
    files |= {name: bench / out for name, out in SPARSE.items()}
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
        ("SD1.5 (synthetic, 2.0 GiB fp16)", files["SD1.5 (synthetic, 2.0 GiB fp16)"]),
        ("SDXL (sparse, 6.5 GiB fp16)", files["sdxl_base.checkpoint.json"]),
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
        name = label.replace(".json", "").replace("_", " ")
        rows.append(f"| {name} | {_gib(size)} | {ours['median'] * 1000:.1f} ms | {comfy} | {ours['found']} |")
    return "\n".join(rows)


SECTIONS = {"loader": bench_loader, "detection": bench_detection}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append", help="run only these sections")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    provision()
    files = _files()
    machine = f"{platform.machine()}, {__import__('os').cpu_count()} CPUs, Python {platform.python_version()}"
    log.info("Machine: %s", machine)
    for name in args.only or list(SECTIONS):
        log.info("\n### %s\n\n%s", name, SECTIONS[name](files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
