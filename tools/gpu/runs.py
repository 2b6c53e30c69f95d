"""The GPU benchmark's cases and runs, in this process: ComfyUI's stock loaders and sampler, the pack's nodes.

``tools/gpu/bench.py`` says what is measured and why; this module does it. Every run samples the same seed with
ComfyUI's ``common_ksampler``; the host waits for the device when the warm-up steps end and when the last step ends
(``Card.synchronize`` from the sampler's progress callback), so a step's time is the device's, and the steps between
run as they do in a real run (the host may run ahead of the device). Nodes are called as ComfyUI calls them: inside
``torch.inference_mode``, through each node class's ``execute``.
"""

from __future__ import annotations

import contextlib
import cProfile
import importlib
import io
import json
import logging
import os
import platform
import pstats
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tools.gpu.fixtures import FixtureMaker
from tools.gpu.report import finish_case
from tools.runtime.provision import REPO

log = logging.getLogger("device_control")

GiB = 1024**3
SEED = 1
CFG = 7.0
SAMPLER = ("euler", "normal")
PREFETCH_ENV = "DEVICE_CONTROL_PREFETCH"


@dataclass(frozen=True)
class Case:
    """One model at one image size on one small card.

    Attributes:
        key: its name on the command line and in the raw output.
        label: its name in the table.
        loader: ``checkpoint`` (ComfyUI's ``CheckpointLoaderSimple``) or ``diffusion_model`` (``UNETLoader``, with
            the VAE from ``VAELoader``).
        fixtures: the fixture keys it needs (``tools/gpu/fixtures.py``): the model, then the VAE if apart.
        size: image width and height.
        card_free: bytes left free on the small card.
        budgets: Move To GPU budgets tried on the small card.
        context: width of its text conditioning; ``pooled``: of its pooled vector (SDXL), or ``None``.
    """

    key: str
    label: str
    loader: str
    fixtures: tuple[str, ...]
    size: int
    card_free: int
    budgets: tuple[str, ...]
    context: int
    pooled: int | None = None


CASES = {
    "sd15": Case("sd15", "SD1.5 512²", "checkpoint", ("sd15_checkpoint",), 512, int(2.3 * GiB), ("1GB", "512MB"), 768),
    "sdxl": Case(
        "sdxl",
        "SDXL 1024²",
        "diffusion_model",
        ("sdxl_unet", "sd15_vae"),
        1024,
        6 * GiB,
        ("3GB", "1.5GB"),
        2048,
        1280,
    ),
}
#: The cases at 64² for ``--simulate``: by default only SD1.5 (a CPU computes a step in about a second); SDXL
#: (``--cases sdxl``) checks its path (its own loaders, a pooled vector) but needs 12 GB of RAM and a 16 GiB card.
SIMULATED_CASES = {
    key: replace(case, label=f"{case.label.split()[0]} 64² (simulated GPU)", size=64) for key, case in CASES.items()
}
SIMULATED_DEFAULT = ("sd15",)


class Bench:
    """ComfyUI and the pack in this process, the card, and the runs of every case.

    Args:
        args: the command line (``tools/gpu/bench.py``).
        raw: the raw output so far; ``save(raw)`` writes it (after every run, so a run killed at its time limit
            still leaves its figures).
    """

    def __init__(self, args: Any, raw: dict[str, Any], save: Callable[[dict[str, Any]], Any]) -> None:
        from tools.runtime.inprocess import import_comfy, import_pack

        self.args = args
        self.raw = raw
        self.save = save
        self.started = time.monotonic()
        self.mm = import_comfy(root=args.comfyui_dir, cpu=args.simulate)
        import comfy.utils
        import torch

        import nodes

        self.torch, self.nodes, self.utils = torch, nodes, comfy.utils
        comfy.utils.PROGRESS_BAR_ENABLED = False  # no tqdm bars between the log lines
        pack = import_pack().__name__
        self.m = {
            name: importlib.import_module(f"{pack}.{name}")
            for name in ("nodes.move_to_gpu", "nodes.offload_to_cpu", "nodes.memory_report", "nodes.state")
        }
        self.prefetch_module = f"{pack}.core.placement.prefetch"
        self.card = self._card(pack)
        self.latents: dict[tuple[str, str], Any] = {}
        self.bandwidth: dict[str, float] = {}

    def _card(self, pack: str) -> Any:
        from tools.gpu.card import CudaCard, SimulatedCard

        if not self.args.simulate:
            return CudaCard()
        target = self.m["nodes.state"].inventory.target("gpu:0")
        backend = importlib.import_module(f"{pack}.core.devices.backends").backend_of(target)
        return SimulatedCard(target, backend)

    # -- the environment ---------------------------------------------------------------------------

    def machine(self) -> dict[str, Any]:
        """What the raw output says about where it ran."""
        try:
            import comfyui_version

            comfy_version = comfyui_version.__version__
        except ImportError:
            comfy_version = "unknown"
        return {
            "card": self.card.describe(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "comfyui": comfy_version,
            "comfyui_offloading": self.offloading(),
            "vram_state": str(getattr(self.mm, "vram_state", "")),
            "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"),
            "pack_commit": commit(),
        }

    def offloading(self) -> str:
        """What ComfyUI's own offloading is here, by feature (Dynamic VRAM, or the legacy partial load)."""
        if self.args.simulate:
            return "none (CPU: ComfyUI cannot drive a simulated GPU)"
        memory = sys.modules.get("comfy.memory_management")
        return "Dynamic VRAM" if getattr(memory, "aimdo_enabled", False) else "legacy low-VRAM"

    def time_left(self) -> float:
        return self.args.time_limit - (time.monotonic() - self.started)

    # -- one case ----------------------------------------------------------------------------------

    def case(self, case: Case, fixtures: FixtureMaker) -> dict[str, Any]:
        """Every run of ``case`` (see the module docstring), the images compared, the floors worked out."""
        result: dict[str, Any] = {"label": case.label, "size": case.size, "card_free": case.card_free, "rows": []}
        paths = [fixtures.get(key) for key in case.fixtures]
        with self.torch.inference_mode():
            model, vae = self.load(case, paths)
            result["total_bytes"] = model_bytes(model)
            conds = self.conditioning(case)
            card = self.card
            stock = "ComfyUI on the CPU" if self.args.simulate else f"ComfyUI's own offloading ({self.offloading()})"
            plan = [("ComfyUI, fully resident", "comfyui", None, None, False)]
            plan.append((stock, "comfyui", None, None, True))
            for budget in case.budgets:
                plan += [(f"ours {budget}, prefetch {on}", "ours", budget, on == "on", True) for on in ("on", "off")]
            plan += [(f"ours all, prefetch {on}", "ours", "all", on == "on", False) for on in ("on", "off")]
            for label, who, budget, prefetch, small in plan:
                if small:
                    card.hold(case.card_free)
                else:
                    card.release()
                row = self.run(case, model, conds, label, who, budget, prefetch)
                row["card"] = f"{case.card_free / GiB:.1f} GiB free" if small else "whole card"
                result["rows"].append(row)
                self.checkpoint(case, result)
            if self.args.profile and case.budgets:
                card.hold(case.card_free)
                self.profile(case, model, conds, case.budgets[-1])
            card.release()
            self.compare_images(case, vae, result["rows"])
        del model, vae
        self.clean()
        return finish_case(result, self.bandwidth["pinned"])

    def profile(self, case: Case, model: Any, conds: tuple, budget: str) -> None:
        """One more run of ours at ``budget``, prefetch on, under cProfile (not in the table: profiling slows the
        host): where the host's time goes, written to ``profile_<case>.txt`` beside the JSON."""
        if self.time_left() <= 0:
            return
        profiler = cProfile.Profile()
        profiler.enable()
        try:
            row = self.run(case, model, conds, f"ours {budget}, prefetch on, profiled", "ours", budget, True)
        finally:
            profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(45)
        heading = f"{case.label}, ours {budget}, prefetch on, under cProfile: {row.get('step_ms', 0):.1f} ms a step\n"
        (self.args.out / f"profile_{case.key}.txt").write_text(heading + text.getvalue())

    def load(self, case: Case, paths: list[Path]) -> tuple[Any, Any]:
        """The case's model and VAE from ComfyUI's own loaders (weights in RAM until a sampler loads them)."""
        import folder_paths

        for path in paths:
            folder_paths.add_model_folder_path(path.parent.name, str(path.parent))
        started = time.perf_counter()
        if case.loader == "checkpoint":
            model, _clip, vae = self.nodes.CheckpointLoaderSimple().load_checkpoint(paths[0].name)[:3]
        else:
            (model,) = self.nodes.UNETLoader().load_unet(paths[0].name, "default")
            (vae,) = self.nodes.VAELoader().load_vae(paths[1].name)
        log.info("[Device Control] %s loaded by ComfyUI in %.1f s", case.label, time.perf_counter() - started)
        return model, vae

    def conditioning(self, case: Case) -> tuple[list, list]:
        """Positive and negative conditioning as CLIP Text Encode shapes it (seeded values: the text encoder's
        output does not change the step's cost, and leaving it out keeps the card for the diffusion model)."""
        generator = self.torch.Generator().manual_seed(SEED)

        def one() -> list:
            extra = (
                {} if case.pooled is None else {"pooled_output": self.torch.randn(1, case.pooled, generator=generator)}
            )
            return [[self.torch.randn(1, 77, case.context, generator=generator), extra]]

        return one(), one()

    # -- one run -----------------------------------------------------------------------------------

    def run(
        self, case: Case, model: Any, conds: tuple, label: str, who: str, budget: str | None, prefetch: bool | None
    ) -> dict[str, Any]:
        """One run: move (ours), sample, read the residency, clean up; a failure is recorded, never raised."""
        row: dict[str, Any] = {"run": label, "who": who, "budget": budget, "prefetch": prefetch}
        row["at_s"] = round(time.monotonic() - self.started, 1)  # when it ran: beside the fixture process or not
        if who == "comfyui" and self.args.simulate:
            row["device"] = "cpu"  # ComfyUI cannot drive a simulated GPU
        if self.time_left() <= 0:
            row["skipped"] = f"time limit ({self.args.time_limit:.0f} s) reached"
            log.warning("[Device Control] %s / %s: skipped, %s", case.label, label, row["skipped"])
            return row
        used = model
        try:
            if who == "ours":
                row["prefetch_switched"] = self.use_prefetch(bool(prefetch))
                moved = self.m["nodes.move_to_gpu"].MoveToGPU.execute(model, self.card.device_id, budget, False)
                used, row["summary"] = moved.args[0], moved.args[2]
            row.update(self.sample(case, used, conds, label))
            row.update(self.residency(used))
            log.info("[Device Control] %s / %s: %.1f ms per step", case.label, label, row["step_ms"])
        except Exception as exc:
            log.error("[Device Control] %s / %s failed:\n%s", case.label, label, traceback.format_exc())
            row["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            row["left_allocated"] = self.clean(used if who == "ours" else None)
        return row

    def use_prefetch(self, on: bool) -> bool:
        """Prefetch on or off for the models moved from now on, as ``DEVICE_CONTROL_PREFETCH`` sets it at start;
        whether the pack has that switch (a pack without it is recorded, not failed)."""
        os.environ[PREFETCH_ENV] = "on" if on else "off"
        switch = getattr(importlib.import_module(self.prefetch_module), "use_prefetch", None)
        if switch is None:
            log.warning("[Device Control] the pack has no prefetch switch: the prefetch rows run its default")
            return False
        switch(on)
        return True

    def sample(self, case: Case, model: Any, conds: tuple, label: str) -> dict[str, Any]:
        """ComfyUI's ``common_ksampler`` on the case's empty latent: the mean step of the timed window (see the
        module docstring), the host's time between steps, the peak allocated during the run."""
        warm_up, steps = self.args.warm_up, self.args.warm_up + self.args.timed
        stamps: dict[int, float] = {}

        def hook(value: int, total: int, *_args: Any, **_kwargs: Any) -> None:
            if total != steps:  # a load's progress bar, not the sampler's
                return
            if value in (warm_up, steps):  # the ends of the timed window: the device's work done
                self.card.synchronize()
            stamps[int(value)] = time.perf_counter()

        latent = {"samples": self.torch.zeros(1, 4, case.size // 8, case.size // 8)}
        passes = [0]  # how often the sampler runs the diffusion model: once a step, or twice where it splits a batch
        counting = model.model.diffusion_model.register_forward_pre_hook(
            lambda *_args: passes.__setitem__(0, passes[0] + 1)
        )
        self.card.reset_peak()
        self.utils.set_progress_bar_global_hook(hook)
        started = time.perf_counter()
        try:
            (out,) = self.nodes.common_ksampler(model, SEED, steps, self.args.cfg, *SAMPLER, *conds, latent)
            self.card.synchronize()
        finally:
            self.utils.set_progress_bar_global_hook(None)
            counting.remove()
        ended = time.perf_counter()
        if sorted(stamps) != list(range(1, steps + 1)):
            raise RuntimeError(f"the sampler reported steps {sorted(stamps)}, not 1..{steps}")
        stamps[0] = started
        host = [(stamps[i] - stamps[i - 1]) * 1000 for i in range(1, steps + 1)]
        self.latents[(case.key, label)] = out["samples"].float().cpu()
        return {
            "step_ms": (stamps[steps] - stamps[warm_up]) * 1000 / self.args.timed,
            "steps_ms_host": [round(d, 2) for d in host],  # between callbacks, the device waited for at the ends
            "run_s": ended - started,
            "passes_per_step": passes[0] / steps,
            "peak_bytes": self.card.peak(),
            "peak_reserved_bytes": self.card.peak_reserved(),
        }

    def residency(self, model: Any) -> dict[str, Any]:
        """Where the model is after sampling: the VRAM Report's reading, and the bytes torch says are on CUDA."""
        reports = self.m["nodes.memory_report"]
        if hasattr(reports, "make_report"):  # the node's own reading, without its log of the whole report
            text = reports.make_report(model, "bench").to_json()
        else:
            text = reports.VRAMReport.execute(label="bench", devices="all", value=model).args[2]
        subject = json.loads(text).get("subject") or {}
        figures = {"resident_bytes": (subject.get("resident") or {}).get(self.card.device_id, 0)}
        tensors = [*model.model.parameters(), *model.model.buffers()]
        figures["cuda_bytes"] = sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cuda")
        figures["allocated_bytes"] = self.card.allocated()
        return figures

    def clean(self, moved: Any = None) -> int:
        """Offload what we moved, unload what ComfyUI loaded, empty the caches; the bytes still allocated."""
        if moved is not None:
            with contextlib.suppress(Exception):
                self.m["nodes.offload_to_cpu"].OffloadToCPU.execute("full", "1GB", True, model=moved)
        self.mm.unload_all_models()
        self.mm.soft_empty_cache()
        self.card.empty_cache()
        return self.card.allocated()

    def compare_images(self, case: Case, vae: Any, rows: list[dict[str, Any]]) -> None:
        """Decode every run's latent (ComfyUI's VAE Decode, the whole card free) and compare it with ComfyUI's own
        fully resident run: the largest difference in 0-255 of the image, and of the latent itself."""
        decoded = {}
        for (key, label), samples in self.latents.items():
            if key != case.key:
                continue
            try:
                image = self.nodes.VAEDecode().decode(vae, {"samples": samples})[0]
                decoded[label] = (image.float().cpu() * 255).round().clamp(0, 255)
            except Exception:
                log.error("[Device Control] %s / %s: decoding failed:\n%s", case.label, label, traceback.format_exc())
        reference = rows[0]["run"]
        for row in rows:
            samples = self.latents.get((case.key, row["run"]))
            if samples is None or (case.key, reference) not in self.latents:
                continue
            row["latent_max_diff"] = float((samples - self.latents[(case.key, reference)]).abs().max())
            if row["run"] in decoded and reference in decoded:
                row["image_diff_255"] = int((decoded[row["run"]] - decoded[reference]).abs().max())
        self.latents = {k: v for k, v in self.latents.items() if k[0] != case.key}
        self.clean()

    # -- output ------------------------------------------------------------------------------------

    def checkpoint(self, case: Case, result: dict[str, Any]) -> None:
        """Write what is known so far (a run killed at its time limit still leaves its figures)."""
        self.raw["cases"][case.key] = result
        self.save(self.raw)


def model_bytes(model: Any) -> int:
    """The model's bytes as ComfyUI loaded them: the diffusion model's parameters and buffers, and the few of its
    wrapper (the sampling schedule), as the VRAM Report counts them."""
    return sum(t.numel() * t.element_size() for t in (*model.model.parameters(), *model.model.buffers()))


def commit() -> str:
    """The repository's commit, with ``+changes`` when the tree differs from it (``unknown`` without git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
