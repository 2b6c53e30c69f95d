"""The benchmark sections: what each measures, ``runs`` times, and the Markdown table it makes.

Each section is ``section(runs, paths, worker, aggregate) -> (raw runs, table)``; ``tools/bench/run_all.py`` drives
them and writes both. Cells are medians with the smallest and largest run (``Spread.show``).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

from tools.bench.format import DETECTED_FILES, SD15, SDXL, GiB, Section, Worker, fmt_gib, fmt_ms, fmt_ratio, fmt_s
from tools.bench.loads import loader, split_loaders
from tools.runtime.provision import REPO, fixtures_dir, venv_python


def detection(runs: int, paths: dict[str, Path], worker: Worker, aggregate: Callable) -> tuple[list, str]:
    rows = [
        "| file | size | Device Control (header only) | ComfyUI (state dict + detection) | class |",
        "| --- | --- | --- | --- | --- |",
    ]
    raw = []
    for label in (SD15, *DETECTED_FILES):
        path = paths[label]
        size = path.stat().st_size
        ours = [worker("detect", "ours", str(path), "7") for _ in range(runs)]
        theirs = [worker("detect", "comfyui", str(path), "3") for _ in range(runs)] if size < 8 * GiB else []
        raw.append({"file": label, "ours": ours, "comfyui": theirs})
        comfy = (
            aggregate([t["median"] * 1000 for t in theirs]).show(lambda v: f"{v:.0f} ms")
            if theirs
            else "not run (larger than this machine's RAM allows)"
        )
        mine = aggregate([o["median"] * 1000 for o in ours]).show(fmt_ms)
        rows.append(f"| {label} | {fmt_gib(size)} | {mine} | {comfy} | {ours[0]['found']} |")
    return raw, "\n".join(rows)


OPS_COLUMNS = ["plain fp32", "ours, no cast", "ComfyUI float16", "ours float16", "ComfyUI bfloat16", "ours bfloat16"]


def ops(runs: int, _paths: dict[str, Path], worker: Worker, aggregate: Callable) -> tuple[list, str]:
    raw = [worker("ops") for _ in range(runs)]
    rows = [
        "| layer (CPU, fp32 input) | " + " | ".join(OPS_COLUMNS) + " | ours / ComfyUI fp16 | ours / ComfyUI bf16 "
        "| no cast / plain |",
        "| --- |" + " --- |" * (len(OPS_COLUMNS) + 3),
    ]
    for label in raw[0]:
        per_run = [run[label] for run in raw]
        cells = aggregate(per_run)
        ratios = aggregate(
            [
                {
                    "fp16": r["ours float16"] / r["ComfyUI float16"],
                    "bf16": r["ours bfloat16"] / r["ComfyUI bfloat16"],
                    "plain": r["ours, no cast"] / r["plain fp32"],
                }
                for r in per_run
            ]
        )
        shown = " | ".join(cells[column].show(lambda v: f"{v:.2f} ms") for column in OPS_COLUMNS)
        rows.append(
            f"| {label} | {shown} | {ratios['fp16'].show(fmt_ratio)} | {ratios['bf16'].show(fmt_ratio)} "
            f"| {ratios['plain'].show(fmt_ratio)} |"
        )
    return raw, "\n".join(rows)


def patching(runs: int, paths: dict[str, Path], worker: Worker, aggregate: Callable) -> tuple[list, str]:
    lora = fixtures_dir() / "bench" / "bench_sd15_lora_r32.safetensors"
    code = (
        "import sys, tools.fixtures.make as m, tools.runtime.inprocess as c; from pathlib import Path\n"
        "c.import_comfy(); m.make_sd15_lora(Path(sys.argv[1]), rank=32)"
    )
    subprocess.run([str(venv_python()), "-c", code, str(lora)], cwd=REPO, check=True, capture_output=True)
    raw = [worker("patch", str(paths[SD15]), str(lora)) for _ in range(runs)]
    base_label = next(iter(raw[0]))
    rows = [
        "| rank-32 LoRA on the SD1.5 UNet (fp16, CPU) | patch + restore | ratio to ComfyUI (same run) | layers "
        "| restore bit-exact |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label in raw[0]:
        times = aggregate([run[label]["ms"] for run in raw])
        ratio = aggregate([run[label]["ms"] / run[base_label]["ms"] for run in raw])
        exact = all(run[label]["exact"] for run in raw)
        rows.append(
            f"| {label} | {times.show(lambda v: f'{v:.0f} ms')} | {ratio.show(fmt_ratio)} | {raw[0][label]['layers']} "
            f"| {exact} |"
        )
    return raw, "\n".join(rows)


def policy(runs: int, paths: dict[str, Path], worker: Worker, aggregate: Callable) -> tuple[list, str]:
    raw = [worker("policy", str(paths[SD15])) for _ in range(runs)]
    rows = [
        "| budget (of the 1.6 GiB fp16 UNet) | policy | resident | streamed per step | streamed layers "
        "| casting room | step (simulated GPU) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, r in raw[0].items():
        policy_name, share = key.split("|")
        step = aggregate([run[key]["ms"] for run in raw]).show(lambda v: f"{v:.0f} ms")
        rows.append(
            f"| {float(share):.0%} | {policy_name} | {fmt_gib(r['resident'])} | {fmt_gib(r['total'] - r['resident'])} "
            f"| {r['streamed_layers']} | {r['reserve'] / 1024**2:.0f} MiB | {step} |"
        )
    return raw, "\n".join(rows)


def panel(runs: int, _paths: dict[str, Path], worker: Worker, aggregate: Callable) -> tuple[list, str]:
    raw = [worker(module="tools.bench.panel") for _ in range(runs)]
    load = worker("load", module="tools.bench.panel")["load"]
    r = aggregate(raw)
    rows = [
        "| measured with the example workflow's models loaded | Device Control | ComfyUI |",
        "| --- | --- | --- |",
    ]
    for when, figures in (("idle", r["idle_latency"]), ("while sampling", r["latency"])):
        ours, theirs = figures["snapshot"], figures["system_stats"]
        for what, key in (("median", "median_ms"), ("p99", "p99_ms"), ("max", "max_ms")):
            rows.append(
                f"| GET latency {when}, {what} of 1,000 | {ours[key].show(fmt_ms)} | {theirs[key].show(fmt_ms)} |"
            )
        made = figures["snapshot_made"]
        rows.append(
            f"| snapshot made on the server {when}, median / p99 | {made['median_ms'].show(fmt_ms)} / "
            f"{made['p99_ms'].show(fmt_ms)} | - |"
        )
    push, flow = r["push"], r["workflow"]
    cost = aggregate([run["workflow"]["open_s"] / run["workflow"]["closed_s"] - 1 for run in raw])
    rows += [
        f"| push thread CPU at 1 s | {push['cpu_share'].show(lambda v: f'{v:.2%}')} of one core "
        f"({push['ms_per_push'].show(fmt_ms)} per push) | - |",
        f"| workflow time, panel open / closed | {flow['open_s'].show(lambda v: f'{v:.2f} s')} / "
        f"{flow['closed_s'].show(lambda v: f'{v:.2f} s')}; open costs {cost.show(lambda v: f'{v:+.1%}')} | - |",
        f"| {load['requests']:,} snapshot GETs (4 concurrent clients) with {load['clients']} websocket clients "
        f"listening, while sampling (one run): median / p99 / max | {load['median_ms']:.1f} / {load['p99_ms']:.1f} "
        f"/ {load['max_ms']:.0f} ms; {len(load['errors'])} errors; every client got >= {load['pushes_min']} pushes; "
        f"{load['workflow_runs']} runs, {len(load['workflow_failures'])} failed | - |",
    ]
    table = (
        "\n".join(rows) + "\n\nComfyUI column: its own `GET /system_stats`, interleaved with ours on one connection."
    )
    return [*raw, {"load": load}], table


def soak(_runs: int, _paths: dict[str, Path], worker: Worker, aggregate: Callable) -> tuple[list, str]:
    r = worker(module="tools.bench.soak")
    cycles, warmup = r["cycles"], r["warmup"]
    cycle = aggregate(r["seconds"]).show(fmt_s)
    table = "\n".join(
        [
            "| long soak (one run): load, Move To GPU (2 GB budget), sample, Offload To CPU, decode | Device Control |",
            "| --- | --- |",
            f"| cycles (one prompt each, the checkpoint loaded from disk each time) | {cycles} |",
            f"| cycle time, median (min-max) over the cycles | {cycle} |",
            f"| simulated GPU after each offload (bytes held, every cycle) | {sorted(set(r['gpu_after_offload']))} |",
            f"| RSS after cycle {warmup} (baseline) / after cycle {cycles} | {r['baseline_rss'] / GiB:.2f} GiB / "
            f"{r['final_rss'] / GiB:.2f} GiB |",
            f"| drift / highest RSS after the baseline | {r['drift'] / 1024**2:+.0f} MiB "
            f"({r['drift'] / r['baseline_rss']:+.2%}) / {r['max_rss'] / GiB:.2f} GiB |",
        ]
    )
    return [r], table


#: The links the streaming section measures: PCIe 4 x16 and PCIe 3 x8, for a GPU ten times faster than the
#: host (the copies take ten times the link's time; see ``core.devices.sim.link``).
STREAM_LINKS = ("25GB/s,10us,compute=10x", "7GB/s,10us,compute=10x")
#: Latent side per model: SDXL computes about four times more per pixel, so it runs at a quarter of the pixels.
STREAM_LATENTS = {SD15: 32, SDXL: 16}


def streaming(runs: int, paths: dict[str, Path], worker: Worker, aggregate: Callable) -> tuple[list, str]:
    raw = [
        {
            f"{label}|{link}": worker(str(paths[label]), link, str(latent), module="tools.bench.streaming")
            for label, latent in STREAM_LATENTS.items()
            for link in STREAM_LINKS
        }
        for _ in range(runs)
    ]
    rows = [
        "| model (fp32) | link | budget | resident | streamed per step | transfer | compute | floor "
        "| step, prefetch off | step, prefetch on | on / floor | transfer hidden |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, first in raw[0].items():
        label, link = key.split("|")
        compute = aggregate([run[key]["compute_s"] for run in raw])
        for budget in ("0.5", "0.25", "0.1"):
            row = first["rows"][f"{budget}|on"]
            both = [(run[key]["rows"][f"{budget}|off"], run[key]["rows"][f"{budget}|on"], run[key]) for run in raw]
            floor = [max(run["compute_s"], on["transfer_s"]) for _off, on, run in both]
            off_s, on_s = (
                aggregate([off["step_s"] for off, _on, _run in both]),
                aggregate([on["step_s"] for _o, on, _r in both]),
            )
            ratio = aggregate([on["step_s"] / f for (_off, on, _run), f in zip(both, floor, strict=True)])
            hidden = aggregate([(off["step_s"] - on["step_s"]) / on["transfer_s"] for off, on, _run in both])
            rows.append(
                f"| {label} | {link.split(',')[0]} | {float(budget):.0%} of {fmt_gib(first['total'])} "
                f"| {fmt_gib(row['resident'])} | {fmt_gib(row['streamed_per_step'])} | {fmt_s(row['transfer_s'])} "
                f"| {compute.show(fmt_s)} | {fmt_s(aggregate(floor).median)} | {off_s.show(fmt_s)} "
                f"| {on_s.show(fmt_s)} "
                f"| {ratio.show(fmt_ratio)} | {hidden.show(lambda v: f'{v:.0%}')} |"
            )
    note = (
        "\n\nTimes are host seconds on the simulated GPU with `DEVICE_CONTROL_SIMULATE_LINK=<link>,10us,compute=10x`:"
        " it computes on this machine, and its copies take ten times the link's time, the ratio a GPU ten times "
        "faster than this machine would see (divide by ten for that GPU's seconds). Compute: the step with the "
        "whole UNet resident. Transfer: the link's time for the bytes streamed per step. Floor: "
        "`max(compute, transfer)`. Transfer hidden: (step off - step on) / transfer. ComfyUI's own partial loading "
        "has no row: ComfyUI sees the simulated GPU as the CPU, where it never loads partially, so it cannot run "
        "there."
    )
    return raw, "\n".join(rows) + note


#: The small Flux of the row-slice rows, its latent side (16: 64 image tokens and 64 text tokens a step), and the
#: steps timed per placement (after one that is not: the step prefetch learns the order from).
SLICES_MODEL, SLICES_LATENT, SLICES_STEPS = "Flux 3072, 1 double + 1 single block (fp32)", 16, 4


def slices(runs: int, _paths: dict[str, Path], worker: Worker, aggregate: Callable) -> tuple[list, str]:
    """Row slices against whole layers at the same budgets (``tools/bench/streaming.py flux``), prefetch on."""
    raw = [
        {
            link: worker("flux", link, str(SLICES_LATENT), str(SLICES_STEPS), module="tools.bench.streaming")
            for link in STREAM_LINKS
        }
        for _ in range(runs)
    ]
    rows = [
        "| model | link | budget | streaming | resident | reserve | device peak | streamed per step (copies) "
        "| transfer | compute | step | step / floor | sliced / whole |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for link, first in raw[0].items():
        compute = aggregate([run[link]["compute_s"] for run in raw])
        for key, row in first["rows"].items():
            budget, way = key.split("|")
            if int(budget) == first["total"]:
                continue
            steps = [run[link]["rows"][key]["step_s"] for run in raw]
            floor = [max(run[link]["compute_s"], run[link]["rows"][key]["transfer_s"]) for run in raw]
            versus = aggregate(
                [run[link]["rows"][key]["step_s"] / run[link]["rows"][f"{budget}|whole"]["step_s"] for run in raw]
            )
            rows.append(
                f"| {SLICES_MODEL} | {link.split(',')[0]} | {int(budget) / 1024**2:.0f} MiB | {way} "
                f"| {fmt_gib(row['resident'])} | {row['reserve'] / 1024**2:.0f} MiB | {row['peak'] / 1024**2:.0f} MiB "
                f"| {fmt_gib(row['streamed_per_step'])} ({row['copies_per_step']}) | {fmt_s(row['transfer_s'])} "
                f"| {compute.show(fmt_s)} | {aggregate(steps).show(fmt_s)} "
                f"| {aggregate([t / f for t, f in zip(steps, floor, strict=True)]).show(fmt_ratio)} "
                f"| {versus.show(fmt_ratio) if way == 'sliced' else '-'} |"
            )
    note = (
        "\n\nThe same simulated GPU and links as the streaming table (copies take ten times the link's time). "
        "Whole: every streamed layer crosses whole, and the plan keeps room for three of the largest (the plan "
        "before row slices). Sliced: layers larger than the streaming unit (1/36 of the budget) cross in row "
        "slices, and the reserve is three of the largest piece. Reserve: that room. Device peak: the most the "
        "simulated GPU held from the placement to the end of the steps (weights, copies, activations). "
        "Compute: the step with the whole model resident. Floor: `max(compute, transfer)`. Sliced / whole: the "
        "step with row slices over the step with whole layers at the same budget, run by run."
    )
    return raw, "\n".join(rows) + note


def host(runs: int, _paths: dict[str, Path], worker: Worker, _aggregate: Callable) -> tuple[list, str]:
    """Host cost of streaming on SD1.5 and SDXL, ours beside ComfyUI's low-VRAM path (``tools/bench/host.py``,
    which takes the medians of its own runs)."""
    from tools.bench.host_report import from_json, table

    raw = worker("--runs", str(runs), module="tools.bench.host")
    text, misses = table(from_json(raw))
    return [raw], text + "".join(f"\n\nMissing its target: {miss}." for miss in misses)


TABLES: dict[str, Section] = {
    "loader": loader,
    "split_loaders": split_loaders,
    "detection": detection,
    "ops": ops,
    "patching": patching,
    "policy": policy,
    "panel": panel,
    "soak": soak,
    "streaming": streaming,
    "slices": slices,
    "host": host,
}
