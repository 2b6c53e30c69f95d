"""GGUF against fp16: one denoising step of the synthetic Flux-layout model stored in fp16, Q8_0 and Q4_0, each
loaded by Load Diffusion Model With Device and placed by Move To GPU on a simulated GPU under three budgets, with
ComfyUI's own loader computing the same step on the CPU beside them; prints a Markdown table.

    .runtime/venv/bin/python -m tools.bench.gguf_step [--runs 5] [--warm-up 2] [--raw docs/bench/raw/gguf.json]

The model is ``make_all()["flux"]`` (Flux.1 dev's layout at its real width, one double and one single block, fp16,
1.1 GB); its GGUF copies are quantised by the GGML project's ``gguf`` package (``tools/fixtures/gguf_files.py``: Q8_0
is the example workflow's file, Q4_0 is written to the fixtures' ``bench`` folder). Everything runs in this process:

* ours: each file loaded to the CPU (the fp16 file with dtype ``fp16``, so its weights stay fp16 and are cast
  to float32 layer by layer as they compute; a GGUF file keeps its blocks and dequantises them layer by layer),
  then ``MoveToGPU.execute(model, "gpu:0", budget, False)`` onto a 16 GiB simulated GPU
  (``DEVICE_CONTROL_SIMULATE_GPU``) whose copies are free (``DEVICE_CONTROL_SIMULATE_LINK`` is cleared: no link
  time, as in ``policy.md``). Budgets: ``all``, then 50 % and 25 % of the fp16 model's size (ComfyUI's books,
  ``model_size()``), the same bytes for every file. The step's inputs are placed on the simulated GPU first, as a
  sampler's are on a real one;
* ComfyUI: ``comfy.sd.load_diffusion_model`` of the fp16 file with its default dtype (float32 on a CPU) and with
  ``weight_dtype`` fp16 (its cast layers), computing on the CPU. Stock ComfyUI cannot load GGUF, so its rows are
  the fp16 file's.

A step is ``model.model.apply_model`` on a 1x16x16x16 latent, 8 text tokens 4096 wide, a 2048-wide pooled vector
and guidance 3.5 (the widths of the fixture's conditioning), under ``torch.inference_mode``. At each budget every
variant is placed, then stepped in rounds, one step each a round in an order that rotates, so that drift hits all
alike; the first ``--warm-up`` rounds are not counted (the first step teaches prefetch the layers' order). Per
variant: bytes resident on the GPU (Move To GPU's report), bytes streamed per step (the pack's traffic books for the
device, ``core.devices.tensors.traffic``), the step (median of the rounds, range in brackets), and the step over the
fp16 model's in the same round (medians of those ratios; ComfyUI's rows over the fp16 model fully resident).

This machine computes what the simulated GPU computes: dequantisation and casts are host work here, and a real GPU's
figures will differ (it dequantises in its own kernels, and its fp16 layers need no cast).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench.format import GiB, fmt_ratio
from tools.bench.run_all import Spread, machine
from tools.runtime.provision import REPO

MiB = 1024**2
#: Variants, in the order of the table: label -> (``make_all()`` key or the Q4_0 copy, dtype of our loader).
OURS = {"fp16": ("flux", "fp16"), "GGUF Q8_0": ("flux_gguf", "auto"), "GGUF Q4_0": ("flux_q4_0", "auto")}
COMFYUI = {"ComfyUI, default dtype (CPU)": None, "ComfyUI, weight_dtype fp16 (CPU)": "fp16"}
#: Budgets: Move To GPU's text, or a share of the fp16 model's size.
BUDGETS = ("all", 0.5, 0.25)
Q4_0_FILE = "device_control_flux_dev_d1_Q4_0.gguf"
SIMULATED = "16GiB"


def budget_label(budget: str | float) -> str:
    return budget if isinstance(budget, str) else f"{budget:.0%}"


class Bench:
    """The loaded models, the simulated GPU, the pack's nodes and the inputs of one step."""

    def __init__(self) -> None:
        from tools.runtime.inprocess import import_comfy, import_pack

        os.environ["DEVICE_CONTROL_SIMULATE_GPU"] = SIMULATED  # read when the pack's nodes are imported
        os.environ.pop("DEVICE_CONTROL_SIMULATE_LINK", None)  # copies are free
        self.mm = import_comfy()
        import folder_paths
        import torch

        self.torch = torch
        files = _files()
        for path in files.values():
            folder_paths.add_model_folder_path("diffusion_models", str(path.parent))
        pack = import_pack().__name__
        self.module = lambda name: __import__(f"{pack}.{name}", fromlist=["x"])
        extra = self.module("nodes.state").inventory.extra
        if not extra:
            raise SystemExit("no simulated GPU: the pack was imported before this benchmark set its variables")
        self.sim = extra[0].simulated[0]
        self.traffic = self.module("core.devices.tensors").traffic
        self.models = self._load(files)
        self.fp16_size = self.models["fp16"].model_size()
        generator = torch.Generator().manual_seed(0)
        self.inputs = {
            "x": torch.randn(1, 16, 16, 16, generator=generator),
            "t": torch.tensor([0.5]),
            "c_crossattn": torch.randn(1, 8, 4096, generator=generator),
            "y": torch.randn(1, 2048, generator=generator),
            "guidance": torch.tensor([3.5]),
        }
        self.on_gpu = {name: self.sim.place(value) for name, value in self.inputs.items()}
        self.sizes = {name: model.model_size() for name, model in self.models.items()}
        import comfyui_version

        self.versions = {
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "comfyui": comfyui_version.__version__,
        }

    def _load(self, files: dict[str, Path]) -> dict[str, Any]:
        """ComfyUI's models (loaded first, placed by its own ``load_models_gpu``), then ours, on the CPU."""
        import comfy.sd

        models = {}
        for label, dtype in COMFYUI.items():
            options = {} if dtype is None else {"dtype": self.torch.float16}
            models[label] = comfy.sd.load_diffusion_model(str(files["flux"]), model_options=options)
            self.mm.load_models_gpu([models[label]])
        node = self.module("nodes.load_diffusion_model").LoadDiffusionModelWithDevice
        self.summaries = {}
        for label, (key, dtype) in OURS.items():
            models[label], self.summaries[label] = node.execute(files[key].name, "cpu", dtype).args[:2]
        return models

    def place(self, budget: str | float) -> dict[str, dict[str, Any]]:
        """Every one of our models moved to the simulated GPU under ``budget``; Move To GPU's figures."""
        move = self.module("nodes.move_to_gpu").MoveToGPU
        text = budget if isinstance(budget, str) else f"{self.fp16_size * budget / MiB:.3f}MiB"
        placed = {}
        for label in OURS:
            summary = move.execute(self.models[label], "gpu:0", text, False).args[2]
            report = self.models[label].model.device_control_last_load
            placed[label] = {
                "budget": text,
                "resident": report.resident_bytes,
                "planned_streamed": report.streamed_bytes,
                "summary": summary,
            }
        held = self.sim.allocated() - sum(t.numel() * t.element_size() for t in self.on_gpu.values())
        placed["simulated GPU"] = {"allocated_by_models": held}
        return placed

    def step(self, label: str) -> tuple[float, int, int]:
        """One step of ``label``: seconds, bytes copied onto the simulated GPU meanwhile, and this process's minor
        page faults meanwhile (memory the kernel had to map: fresh buffers the host allocator took from it)."""
        ours = label in OURS
        inputs = dict(self.on_gpu if ours else self.inputs)
        x, t = inputs.pop("x"), inputs.pop("t")
        before, faults = self.traffic(self.sim).to_device, resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        with self.torch.inference_mode():
            started = time.perf_counter()
            out = self.models[label].model.apply_model(x, t, **inputs)
            seconds = time.perf_counter() - started
        moved = self.traffic(self.sim).to_device - before
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        del out
        return seconds, moved, faults

    def rounds(self, budget: str | float, runs: int, warm_up: int) -> dict[str, Any]:
        """Place at ``budget``, then ``warm_up + runs`` rounds of one step per variant (order rotating)."""
        placed = self.place(budget)
        labels = [*OURS, *COMFYUI]
        steps: dict[str, list[float]] = {label: [] for label in labels}
        moved: dict[str, list[int]] = {label: [] for label in labels}
        faults: dict[str, list[int]] = {label: [] for label in labels}
        for index in range(warm_up + runs):
            shift = index % len(labels)
            for label in labels[shift:] + labels[:shift]:
                seconds, nbytes, count = self.step(label)
                if index >= warm_up:
                    steps[label].append(seconds)
                    moved[label].append(nbytes)
                    faults[label].append(count)
        return {"budget": budget_label(budget), "placed": placed, "step_s": steps, "moved": moved, "faults": faults}

    def close(self) -> None:
        self.models.clear()
        self.mm.unload_all_models()
        gc.collect()


def _files() -> dict[str, Path]:
    """The fp16 model, its Q8_0 copy (the example's) and its Q4_0 copy (written once, then reused)."""
    from tools.fixtures.gguf_files import write_gguf
    from tools.fixtures.make import make_all
    from tools.runtime.provision import fixtures_dir

    made = make_all()
    q4_0 = write_gguf(made["flux"], fixtures_dir() / "bench" / Q4_0_FILE, "Q4_0", "flux")
    return {"flux": made["flux"], "flux_gguf": made["flux_gguf"], "flux_q4_0": q4_0}


def measure(runs: int, warm_up: int) -> dict[str, Any]:
    """Every budget's rounds, with the files, sizes, summaries and the machine before and after."""
    before = describe_machine()
    bench = Bench()
    try:
        started = resource.getrusage(resource.RUSAGE_SELF)
        budgets = [bench.rounds(budget, runs, warm_up) for budget in BUDGETS]
        ended = resource.getrusage(resource.RUSAGE_SELF)
        result = {
            "fp16_size": bench.fp16_size,
            "sizes": bench.sizes,
            "load_summaries": bench.summaries,
            "file_sizes": {key: path.stat().st_size for key, path in _files().items()},
            "versions": bench.versions,
            "runs": runs,
            "warm_up": warm_up,
            "budgets": budgets,
            # This process's processor time over the rounds: system time is the kernel's (page faults among it).
            "rounds_cpu_s": {
                "user": round(ended.ru_utime - started.ru_utime, 1),
                "system": round(ended.ru_stime - started.ru_stime, 1),
                "minor_faults": ended.ru_minflt - started.ru_minflt,
            },
        }
    finally:
        bench.close()
    return {**result, "before": before, "after": describe_machine()}


def describe_machine() -> dict[str, Any]:
    """``tools.bench.run_all.machine()`` with the CPU's model and the commit (with whether the code
    measured, ``core/`` and ``nodes/``, differs from it)."""
    found = machine()
    found["cpu_model"] = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        "unknown",
    )  # fmt: skip
    git = lambda *args: subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()  # noqa: E731
    found["commit"] = git("rev-parse", "--short", "HEAD")
    found["uncommitted_in_core_or_nodes"] = bool(git("status", "--porcelain", "--", "core", "nodes"))
    return found


def table(result: dict[str, Any]) -> str:
    """The Markdown table of ``result`` (see :func:`measure`)."""
    lines = [
        "| model | budget (of the fp16 model's size) | stored | resident on the GPU | streamed per step | step | "
        "step / fp16 step, same budget and round | minor page faults per step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for entry in result["budgets"]:
        fp16 = entry["step_s"]["fp16"]
        for label in OURS:
            steps = entry["step_s"][label]
            ratios = [s / f for s, f in zip(steps, fp16, strict=True)]
            placed = entry["placed"][label]
            lines.append(
                f"| {label} | {entry['budget']} ({placed['budget']}) | {_gib(result['sizes'][label])} | "
                f"{_gib(placed['resident'])} | {_gib(statistics.median(entry['moved'][label]))} | "
                f"{Spread(steps).show(_fmt_ms)} | {Spread(ratios).show(fmt_ratio)} | "
                f"{_faults(entry['faults'][label])} |"
            )
    resident = [(entry["step_s"]["fp16"], entry) for entry in result["budgets"] if entry["budget"] == "all"]
    for label in COMFYUI:
        steps = [s for entry in result["budgets"] for s in entry["step_s"][label]]
        faults = [n for entry in result["budgets"] for n in entry["faults"][label]]
        cell = "-"
        if resident:
            fp16, entry = resident[0]
            cell = Spread([s / f for s, f in zip(entry["step_s"][label], fp16, strict=True)]).show(fmt_ratio)
        lines.append(
            f"| {label} | - (CPU, every budget's rounds) | {_gib(result['sizes'][label])} | - | - | "
            f"{Spread(steps).show(_fmt_ms)} | {cell} (against fp16, all) | {_faults(faults)} |"
        )
    return "\n".join(lines)


def _faults(counts: list[int]) -> str:
    """The median of the minor page faults per step, in thousands."""
    return f"{statistics.median(counts) / 1000:.0f} k"


def _gib(value: float) -> str:
    return f"{value / GiB:.3f} GiB"


def _fmt_ms(value: float) -> str:
    return f"{value * 1000:.0f} ms"


def header(result: dict[str, Any], command: str) -> str:
    """What the table was taken on: the machine, its load, the versions, the date and the commit."""
    before, after = result["before"], result["after"]
    versions, cpu = result["versions"], result["rounds_cpu_s"]
    dirty = " (with uncommitted changes in core/ or nodes/)" if before["uncommitted_in_core_or_nodes"] else ""
    return "\n".join(
        [
            f"Command: `{command}`",
            f"Taken {before['date']} to {after['date']}, commit {before['commit']}{dirty}.",
            f"Machine: {before['cpu_model']}, {before['cpus']} cores, {before['ram_gib']} GiB RAM, no GPU; "
            f"Python {before['python']}, torch {versions['torch']} ({versions['torch_threads']} threads), "
            f"ComfyUI {versions['comfyui']}.",
            f"Load average before / after: {' '.join(map(str, before['load_average']))} / "
            f"{' '.join(map(str, after['load_average']))}; CPU busy before {before['cpu_busy_percent']} %.",
            f"{result['runs']} counted rounds after {result['warm_up']} not counted, per budget; "
            f"simulated GPU {SIMULATED}, copies free. Processor time of the rounds: user {cpu['user']} s, system "
            f"{cpu['system']} s, {cpu['minor_faults']} minor page faults.",
        ]
    )


def _invocation() -> list[str]:
    """How this was run: the ComfyUI asked for, the interpreter (relative to the repository where it is inside)."""
    python = Path(sys.executable)
    shown = str(python.relative_to(REPO)) if python.is_relative_to(REPO) else python.name
    version = os.environ.get("DEVICE_CONTROL_COMFYUI")
    return [*([f"DEVICE_CONTROL_COMFYUI={version}"] if version else []), shown, "-m", "tools.bench.gguf_step"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="rounds counted per budget")
    parser.add_argument("--warm-up", type=int, default=2, help="rounds not counted before them")
    parser.add_argument("--raw", type=Path, default=None, help="where to write every round's figures (JSON)")
    args = parser.parse_args(argv)
    command = " ".join([*_invocation(), *(argv if argv is not None else sys.argv[1:])])
    result = measure(args.runs, args.warm_up)
    text = f"{header(result, command)}\n\n{table(result)}\n"
    if args.raw is not None:
        args.raw.parent.mkdir(parents=True, exist_ok=True)
        args.raw.write_text(json.dumps({"command": command, "output": text, **result}, indent=1) + "\n")
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
