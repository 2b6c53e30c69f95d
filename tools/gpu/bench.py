"""Streaming on a small GPU, ours beside ComfyUI's own offloading: ms per sampling step, the link floor, resident
bytes, peak VRAM and the image difference from stock; prints a markdown table and writes the raw figures as JSON.

    python3 tools/gpu/bench.py --comfyui-dir DIR [--fixtures DIR] [--out docs/bench/raw] [--cases sd15,sdxl]
        [--time-limit 240]
    .runtime/venv/bin/python tools/gpu/bench.py --simulate    # no GPU: the pack's simulated GPU, small sizes

One command, from a bare GPU machine with no network (``tools/gpu/session.sh`` runs it there): the synthetic
fixtures are made on the spot by the repository's own generators (``tools/fixtures/make.py``), in a second process
while the first case runs; ComfyUI and the pack run in this process, ComfyUI's stock loaders and
``common_ksampler``, the pack's node classes called as ComfyUI calls them (under ``torch.inference_mode``).

Each case (SD1.5 at 512², SDXL at 1024²) loads its model once with ComfyUI's own loader, then samples the same
seed on:

* the whole card: ComfyUI's own load (everything resident: the compute of a step), then ours (Move To GPU,
  budget ``all``) with prefetch on and off;
* a *small card*: a block held on the GPU so that only ``card_free`` bytes stay free, for ComfyUI and the pack
  alike (``tools/gpu/card.py``); ComfyUI's own offloading there (its legacy low-VRAM partial load, or Dynamic
  VRAM where that ComfyUI has it on), then ours at each budget with prefetch on and off.

Per run: the ms per step over the ``--timed`` steps after ``--warm-up`` steps (the host waits for the device when
the warm-up ends and when the last step ends, not between: steps run as in a real run), the model's bytes resident
on the GPU (the pack's VRAM Report, which reads where every weight is; ComfyUI's own and ours alike), the bytes that
must cross per pass (the model's bytes less the resident ones), the passes the sampler made a step (two where it
runs a batch's halves apart), the link floor ``max(compute, passes x streamed bytes / pinned host-to-device
bandwidth)`` (compute: the fastest fully resident step; bandwidth: a 1 GiB pinned copy, measured first) and the
step over it, the peak allocated during the run, and the largest difference of the decoded
image (0-255) from ComfyUI's own fully resident run (decoded after all runs, with the whole card free). A run that
fails is logged with its traceback and recorded; the others still run. ``--time-limit`` stops starting runs after
that many seconds, so the output always comes back.

``--simulate`` runs the same code on a machine without a GPU: ``DEVICE_CONTROL_SIMULATE_GPU`` (8 GiB) and a link
at the H100's measured pinned speed (``DEVICE_CONTROL_SIMULATE_LINK``), SD1.5 at 64², one warm-up and one timed
step. ComfyUI cannot drive a simulated GPU, so its rows run on the CPU there: a check of the machinery and of the
images, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.gpu.fixtures import FixtureMaker
from tools.gpu.report import table
from tools.gpu.runs import CASES, CFG, SAMPLER, SEED, SIMULATED_CASES, SIMULATED_DEFAULT, Bench, Case

log = logging.getLogger("device_control")

#: The simulated GPU of ``--simulate`` (unless the environment sets one): 8 GiB, and a link at the pinned
#: host-to-device speed measured on an H100 (PCIe gen 5) machine.
SIMULATE_ENV = {"DEVICE_CONTROL_SIMULATE_GPU": "8GiB", "DEVICE_CONTROL_SIMULATE_LINK": "53.3GB/s,10us"}


def write(raw: dict[str, Any], args: argparse.Namespace) -> tuple[Path, Path]:
    """The raw JSON and the markdown table, under ``--out``."""
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "bench_gpu_simulated" if args.simulate else "bench_gpu"
    json_path, md_path = args.out / f"{stem}.json", args.out / f"{stem}.md"
    raw["elapsed_s"] = round(time.monotonic() - raw["_started"], 1)
    json_path.write_text(json.dumps({k: v for k, v in raw.items() if not k.startswith("_")}, indent=1))
    md_path.write_text(table(raw) + "\n")
    return json_path, md_path


#: What a run does unless told otherwise, on a GPU and on the simulated GPU (``cfg`` 1: ComfyUI skips the negative
#: prompt's half of the batch, half the work of a CPU that computes the simulated GPU's steps).
DEFAULTS = {False: {"warm_up": 2, "timed": 4, "cfg": CFG}, True: {"warm_up": 1, "timed": 1, "cfg": 1.0}}


def parse(argv: list[str] | None) -> argparse.Namespace:
    from tools.runtime.provision import REPO, comfyui_dir, fixtures_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comfyui-dir", type=Path, default=None, help="an unpacked ComfyUI (default: the runtime's)")
    parser.add_argument("--fixtures", type=Path, default=None, help="where fixtures are made or found")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench" / "raw")
    parser.add_argument("--cases", default=None, help="comma-separated case keys (default: every case)")
    parser.add_argument("--simulate", action="store_true", help="the pack's simulated GPU, small sizes (no GPU)")
    parser.add_argument("--warm-up", type=int, default=None, help="steps before the timed ones (2; simulated 1)")
    parser.add_argument("--timed", type=int, default=None, help="timed steps (4; simulated 1)")
    parser.add_argument("--budgets", default=None, help="comma-separated budgets for every case's small card")
    parser.add_argument("--cfg", type=float, default=None, help=f"guidance scale ({CFG}; simulated 1)")
    parser.add_argument("--time-limit", type=float, default=240.0, help="no run starts after this many seconds")
    parser.add_argument(
        "--profile", action="store_true", help="one more run of ours per case under cProfile, to profile_<case>.txt"
    )
    parser.add_argument("--make-fixtures", default=None, help=argparse.SUPPRESS)  # the fixture process
    args = parser.parse_args(argv)
    args.comfyui_dir = (args.comfyui_dir or comfyui_dir()).resolve()
    args.fixtures = (args.fixtures or fixtures_dir()).resolve()
    for name, value in DEFAULTS[args.simulate].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        args.case_list = chosen_cases(args.cases, args.budgets, args.simulate)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def chosen_cases(keys: str | None, budgets: str | None, simulate: bool) -> list[Case]:
    """The cases ``--cases`` names (default: every GPU case, or SD1.5 simulated), with ``--budgets`` if given.

    Raises:
        ValueError: a case that does not exist (the message names those that do).
    """
    known = SIMULATED_CASES if simulate else CASES
    names = keys.split(",") if keys else list(SIMULATED_DEFAULT if simulate else known)
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown case(s) {unknown}; known: {sorted(known)}")
    chosen = [known[name] for name in names]
    return [replace(case, budgets=tuple(budgets.split(","))) for case in chosen] if budgets else chosen


def use_simulated_gpu(simulate: bool) -> None:
    """The pack's simulated GPU as ``gpu:0`` (read when the pack is imported), or none: ``gpu:0`` is then the real
    GPU."""
    for name, value in SIMULATE_ENV.items():
        if simulate:
            os.environ.setdefault(name, value)
        else:
            os.environ.pop(name, None)


def run_cases(args: argparse.Namespace, raw: dict[str, Any], fixtures: FixtureMaker) -> None:
    """Measure the link, then run every case; a case that fails is logged and recorded, the next one runs."""
    bench = Bench(args, raw, lambda figures: write(figures, args))
    raw["machine"] = bench.machine()
    bench.bandwidth = raw["bandwidth"] = bench.card.bandwidth()
    log.info("[Device Control] host to device: %s", {k: f"{v / 1e9:.1f} GB/s" for k, v in bench.bandwidth.items()})
    for case in args.case_list:
        if bench.time_left() <= 0:
            raw["errors"][case.key] = f"not run: time limit ({args.time_limit:.0f} s) reached"
            continue
        try:
            raw["cases"][case.key] = bench.case(case, fixtures)
        except Exception as exc:
            log.error("[Device Control] %s failed:\n%s", case.label, traceback.format_exc())
            raw["errors"][case.key] = f"{type(exc).__name__}: {exc}"
        write(raw, args)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.make_fixtures is not None:
        from tools.gpu.fixtures import make_fixtures_here

        return make_fixtures_here(args.make_fixtures.split(","), args.fixtures, args.comfyui_dir)
    use_simulated_gpu(args.simulate)
    needed = [key for case in args.case_list for key in case.fixtures]
    fixtures = FixtureMaker(list(dict.fromkeys(needed)), args.fixtures, args.comfyui_dir)
    raw: dict[str, Any] = {
        "_started": time.monotonic(),
        "tool": "tools/gpu/bench.py",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": "simulated" if args.simulate else "gpu",
        "settings": {"warm_up": args.warm_up, "timed": args.timed, "cfg": args.cfg, "sampler": SAMPLER, "seed": SEED},
        "cases": {},
        "errors": {},
        "fixtures": fixtures.ready,  # filled in as they come
    }
    try:
        run_cases(args, raw, fixtures)
    except Exception as exc:
        log.error("[Device Control] the benchmark could not start:\n%s", traceback.format_exc())
        raw["errors"]["start"] = f"{type(exc).__name__}: {exc}"
    finally:
        fixtures.close()
    json_path, _md = write(raw, args)
    sys.stdout.write(table(raw) + "\n")
    log.info("[Device Control] raw figures in %s", json_path)
    failed = [row["run"] for case in raw["cases"].values() for row in case.get("rows", []) if "error" in row]
    return 1 if raw["errors"] or failed else 0


if __name__ == "__main__":
    sys.exit(main())
