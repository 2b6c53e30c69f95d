"""Host cost of streaming, counted and timed on full-size SD1.5 and SDXL UNets: ours beside ComfyUI's low-VRAM path.

    .runtime/venv/bin/python -m tools.bench.host [--models sd15,sdxl] [--runs 3] [--out docs/bench]
    .runtime/venv/bin/python -m tools.bench.host --quick     # a small SD1.5-shaped UNet, one budget: seconds

On a real GPU a streamed step was bound by the host, not the link (``GPU_RUNS.md``): what decides it is the Python
work each streamed layer does to get its weights onto the device, and the work a sampling call does once (load,
plan, settle). Per model and budget (0, 25 % and 50 % of the UNet's bytes) this prints, in one process:

* **ours**: the UNet placed by Move To GPU's own path (``nodes.bridge.moves.move``) on a simulated GPU
  (``DEVICE_CONTROL_SIMULATE_GPU``, copies free of link cost), sampled by ComfyUI's sampler (euler, cfg 1: one
  UNet forward a step). The pack's Python calls are counted with ``sys.setprofile``: functions in files under
  the repository's ``core/`` and ``nodes/``, the simulated backend's own modules excluded
  (``core/devices/sim*.py``, ``core/devices/backends/simulated.py``). One forward is half the difference between a
  3-step and a 1-step sampling call; what a sampling call does once is the 1-step call less one forward;
* **ComfyUI**: the same module tree loaded by ComfyUI's own ``ModelPatcher.load(lowvram_model_memory=...)`` on
  the host (its layers beyond the budget take its ``comfy.ops`` cast path), run forward by forward, its calls
  counted in files under ``comfy/`` the same way.

Weights are float32 (SDXL's bfloat16) and the input too, so no layer casts a dtype on either side: what a streamed
layer costs beyond a resident one is host work. Our times are taken without the time spent in the simulated backend's
methods (its copies into the ring, host memcpys here and a copy engine's work on a GPU; its streams and events:
:class:`BackendTime`), but they keep the simulated device's own Python for each operation on its tensors, which
cancels against the resident forward except for the operations streaming adds (a sliced layer's slices); ComfyUI's
side computes on the host, where its casts copy nothing. The calls are the figure to compare here, the times a GPU
run confirms. A layer call is a forward of a layer with the cast protocol
(each runs once a forward); per streamed layer call, a side's calls are its calls in a forward less what its
resident layers take (its calls per layer with everything resident), over the streamed layer calls; host time is
the forward's time less the same side's forward with everything resident, over the streamed layer calls.
Figures are medians of ``--runs`` runs (counts do not vary). The latent is 8x8, one text context: compute is small.
Per budget, a steady forward of ours also counts its group copies and its host waits for the device's computations
(``core.devices.sim.link.ComputeClock``: a synchronisation, an event after them, a blocking copy or a value read
that waits for work the host had not waited for), which on a GPU cost the host its lead.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench.host_counters import BackendTime, Calls, comfy_calls, pack_calls
from tools.bench.host_report import SHARES, table, write_page

SIMULATED_GPU = "16GiB"

#: The published SDXL 1.0 base UNet hyperparameters (as ComfyUI's detection reports them).
SDXL_UNET_CONFIG = {
    "use_checkpoint": False,
    "image_size": 32,
    "out_channels": 4,
    "use_spatial_transformer": True,
    "legacy": False,
    "num_classes": "sequential",
    "adm_in_channels": 2816,
    "in_channels": 4,
    "model_channels": 320,
    "num_res_blocks": [2, 2, 2],
    "transformer_depth": [0, 0, 2, 2, 10, 10],
    "channel_mult": [1, 2, 4],
    "transformer_depth_middle": 10,
    "use_linear_in_transformer": True,
    "context_dim": 2048,
    "num_head_channels": 64,
    "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10],
    "use_temporal_attention": False,
    "use_temporal_resblock": False,
}


def unet_configs() -> dict[str, dict[str, Any]]:
    """The models measured: full-size SD1.5 and SDXL, and ``quick``, an SD1.5-shaped UNet 32 channels wide."""
    from tools.fixtures.make import SD15_UNET_CONFIG

    quick = dict(SD15_UNET_CONFIG, model_channels=32, context_dim=32, num_heads=2)
    return {"sd15": dict(SD15_UNET_CONFIG), "sdxl": dict(SDXL_UNET_CONFIG), "quick": quick}


def _timed(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def _median(values: list[float]) -> float:
    return statistics.median(values)


class Unet:
    """One UNet built by ComfyUI from its hyperparameters, weights zero (compute does not depend on their values),
    in float32 (SDXL in bfloat16), held by a stock ``ModelPatcher`` on the host; and its inputs for one forward and
    one sampling."""

    def __init__(self, name: str) -> None:
        import comfy.model_patcher
        import comfy.supported_models
        import torch

        self.name, self.torch = name, torch
        family = comfy.supported_models.SDXL if name == "sdxl" else comfy.supported_models.SD15
        config = family(unet_configs()[name])
        self.dtype = torch.bfloat16 if name == "sdxl" else torch.float32  # SDXL in float32 would take 10 GB
        config.set_inference_dtype(self.dtype, None)
        cpu = torch.device("cpu")
        model = config.get_model({}, "", device=cpu)
        with torch.no_grad():
            for tensor in model.state_dict().values():
                tensor.zero_()
        self.patcher = comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)
        self.unet = model.diffusion_model
        self.total = self.patcher.model_size()
        self.context = torch.zeros(1, 77, config.unet_config["context_dim"], dtype=self.dtype)
        adm = config.unet_config.get("adm_in_channels")
        self.y = torch.zeros(1, adm, dtype=self.dtype) if adm else None
        self.pooled = torch.zeros(1, 1280) if adm else None

    def layers(self) -> list[Any]:
        """The layers that speak the cast protocol (each runs once a forward)."""
        return [m for m in self.unet.modules() if hasattr(m, "comfy_cast_weights")]

    def inputs(self, place: Callable[[Any], Any] = lambda tensor: tensor) -> dict[str, Any]:
        """One forward's inputs, each put where ``place`` puts it (the device the model computes on, as a sampler
        puts them: a streamed layer's device is its input's)."""
        torch = self.torch
        made = {"x": torch.zeros(1, 4, 8, 8, dtype=self.dtype), "timesteps": torch.tensor([500.0])}
        made.update(context=self.context, y=self.y)
        return {name: None if tensor is None else place(tensor) for name, tensor in made.items()}

    def forward(self, inputs: dict[str, Any] | None = None) -> None:
        with self.torch.inference_mode():
            self.unet(**(inputs or self.inputs()))

    def sample(self, patcher: Any, steps: int) -> None:
        """One sampling call as KSampler makes it: euler, cfg 1 (one UNet forward a step), an 8x8 latent."""
        import comfy.sample

        torch = self.torch
        extra = {"pooled_output": self.pooled} if self.pooled is not None else {}
        positive = [[self.context.float(), extra]]
        latent = torch.zeros(1, 4, 8, 8)
        comfy.sample.sample(
            patcher,
            torch.zeros_like(latent),
            steps,
            1.0,
            "euler",
            "normal",
            positive,
            positive,
            latent,
            disable_pbar=True,
            seed=0,
        )


def _forward_figures(
    unet: Unet,
    counter: Callable[[], Calls],
    runs: int,
    inputs: dict[str, Any],
    *,
    learns: bool,
    backend: BackendTime | None = None,
) -> dict[str, Any]:
    """Calls in one forward and its median time over ``runs`` (less the time in the simulated ``backend``, where
    given). Where the placement ``learns`` the order the model runs in (its first pass, ended as the second begins),
    the forward counted is the third, and what the first two did beyond it is kept as ``learn_calls`` (once in a
    model's life: the order is kept for later plans)."""

    def forward() -> None:
        unet.forward(inputs)

    def host_seconds() -> float:
        before = backend.seconds if backend is not None else 0.0
        seconds = _timed(forward)
        return seconds - (backend.seconds - before if backend is not None else 0.0)

    learned = 0
    if learns:
        with counter().counting() as first_two:
            forward()
            forward()
        learned = first_two.total
    with counter().counting() as calls:
        forward()
    seconds = [host_seconds() for _ in range(runs)]
    figures = {"calls": calls.total, "ops_calls": calls.by_function, "forward_s": _median(seconds)}
    return {**figures, "learn_calls": learned - 2 * calls.total} if learns else figures


def _sampling_figures(unet: Unet, patcher: Any, runs: int) -> dict[str, Any]:
    """What one sampling call does once: the calls of a 1-step call less half the difference to a 3-step one (the
    model is loaded already, as when a queue runs again); its time is that of ComfyUI's ``load_models_gpu`` and
    the patcher's ``cleanup``, the two places a sampling call reaches us outside the forwards."""
    import comfy.model_management

    counted = {}
    for steps in (1, 3):
        with pack_calls().counting() as calls:
            unet.sample(patcher, steps)
        counted[steps] = calls
    one, three = counted[1], counted[3]
    per_forward = (three.total - one.total) / 2

    def load_and_settle() -> None:
        comfy.model_management.load_models_gpu([patcher])
        patcher.cleanup()

    load_and_settle()
    seconds = [_timed(load_and_settle) for _ in range(runs)]
    return {
        "sampling_forward_calls": per_forward,
        "once_calls": one.total - per_forward,
        "once_s": _median(seconds),
        "once_by_root": _once(one.by_root, three.by_root),
        "once_by_function": dict(list(_once(one.by_function, three.by_function).items())[:25]),
    }


def _once(one: Counter[str], three: Counter[str]) -> dict[str, float]:
    """Per key, what a 1-step call does beyond one forward, largest first."""
    rows = {key: count - (three[key] - count) / 2 for key, count in one.items()}
    return {key: n for key, n in sorted(rows.items(), key=lambda kv: -kv[1]) if n}


def _budget_text(unet: Unet, share: float) -> str:
    return "all" if share >= 1 else f"{int(unet.total * share)}B"


def ours(unet: Unet, runs: int, inventory: Any, pack: str) -> dict[float, dict[str, Any]]:
    """Per share of the model's bytes: placed by Move To GPU's path on the simulated GPU, then measured."""
    moves = __import__(f"{pack}.nodes.bridge.moves", fromlist=["x"])
    engines = __import__(f"{pack}.core.placement.engine", fromlist=["x"])
    transfer = __import__(f"{pack}.core.devices.transfer", fromlist=["x"])
    simulated = __import__(f"{pack}.core.devices.backends.simulated", fromlist=["x"])
    results = {}
    for share in (1.0, *SHARES):
        patcher = moves.move(unet.patcher, "gpu:0", _budget_text(unet, share), False, inventory).value
        engine = engines.partial_model_of(patcher.model)
        inputs = unet.inputs(lambda tensor, target=engine.target: transfer.to_target(tensor, target))
        with BackendTime().watching(simulated.SimulatedBackend) as backend:
            figures = _forward_figures(unet, pack_calls, runs, inputs, learns=True, backend=backend)
        clock = engine.target.link.compute  # the simulated device's clock for its computations
        copies, waits = engine.ring.stats.copies, clock.waits
        unet.forward(inputs)  # a steady forward's group copies: each group once, the next step's first ahead
        figures.update(group_copies=engine.ring.stats.copies - copies, groups=engine.ring.groups)
        figures["host_waits"] = clock.waits - waits  # for computations it had not waited for: none from locked slabs
        figures.update(_sampling_figures(unet, patcher, runs))
        figures["layers"] = sum(layer.streamable for layer in engine.layers())
        figures["streamed"] = len(engine.streamed_layers())
        figures.pop("ops_calls")
        results[share] = figures
    return results


def comfy_side(unet: Unet, runs: int, comfy_root: Path) -> dict[float, dict[str, Any]]:
    """Per share: the same tree loaded by ComfyUI's ``ModelPatcher.load`` in low-VRAM mode on the host."""
    cpu = unet.torch.device("cpu")
    results = {}
    for share in (1.0, *SHARES):
        unet.patcher.unpatch_model(cpu, unpatch_weights=True)
        unet.patcher.load(cpu, lowvram_model_memory=int(unet.total * share), full_load=share >= 1)
        figures = _forward_figures(unet, lambda: comfy_calls(comfy_root), runs, unet.inputs(), learns=False)
        layers = unet.layers()
        figures["layers"] = len(layers)
        figures["streamed"] = sum(hasattr(m, "prev_comfy_cast_weights") for m in layers)
        figures["layer_own_calls"] = sum(n for k, n in figures.pop("ops_calls").items() if k.startswith("ops.py:"))
        results[share] = figures
    unet.patcher.unpatch_model(cpu, unpatch_weights=True)
    return results


def per_layer(ours_: dict[float, dict], comfy: dict[float, dict]) -> dict[float, dict[str, float]]:
    """Calls and host microseconds per streamed layer call, each side; and per resident layer call (share 1)."""
    full, cfull = ours_[1.0], comfy[1.0]
    resident = full["calls"] / full["layers"]  # our calls per layer with every layer resident
    comfy_resident = cfull["layer_own_calls"] / cfull["layers"]
    rows = {1.0: {"ours_calls": resident, "comfy_calls": comfy_resident}}
    for share in SHARES:
        mine, theirs = ours_[share], comfy[share]
        streamed, cstreamed = max(1, mine["streamed"]), max(1, theirs["streamed"])
        rows[share] = {
            "ours_calls": (mine["calls"] - resident * (mine["layers"] - mine["streamed"])) / streamed,
            "comfy_calls": (theirs["calls"] - cfull["calls"]) / cstreamed + comfy_resident,
            "ours_us": (mine["forward_s"] - full["forward_s"]) / streamed * 1e6,
            "comfy_us": (theirs["forward_s"] - cfull["forward_s"]) / cstreamed * 1e6,
        }
    return rows


def measure(name: str, runs: int, inventory: Any, pack: str, comfy_root: Path) -> dict[str, Any]:
    """Both sides for one model; the model is freed afterwards."""
    import comfy.model_management

    unet = Unet(name)
    try:
        theirs = comfy_side(unet, runs, comfy_root)
        mine = ours(unet, runs, inventory, pack)
    finally:
        comfy.model_management.unload_all_models()
    del unet
    gc.collect()
    return {"ours": mine, "comfy": theirs, "per_layer": per_layer(mine, theirs)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m tools.bench.host", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="sd15,sdxl", help="comma-separated: sd15, sdxl, quick")
    parser.add_argument("--runs", type=int, default=2, help="timed runs per figure (the median is kept)")
    parser.add_argument("--quick", action="store_true", help="the small SD1.5-shaped UNet, one run: a smoke test")
    parser.add_argument("--out", type=Path, default=None, help="write host_raw.txt and host.md there")
    args = parser.parse_args(argv)
    models, runs = (["quick"], 1) if args.quick else (args.models.split(","), args.runs)
    os.environ.setdefault("DEVICE_CONTROL_SIMULATE_GPU", SIMULATED_GPU)
    os.environ.pop("DEVICE_CONTROL_SIMULATE_LINK", None)  # copies free of link cost: host work alone
    from tools.runtime.inprocess import import_comfy, import_pack
    from tools.runtime.provision import comfyui_dir

    import_comfy()
    import torch

    torch.set_num_threads(1)  # host work is one thread's; a busy machine's threads only wait for each other
    pack = import_pack().__name__
    inventory = __import__(f"{pack}.nodes.state", fromlist=["x"]).inventory
    results = {name: measure(name, runs, inventory, pack, comfyui_dir()) for name in models}
    text, misses = table(results)
    raw = f"{text}\n\n" + "\n".join(f"missed: {miss}" for miss in misses) + f"\n\n{json.dumps(results)}\n"
    sys.stdout.write(raw)
    if args.out is not None:
        write_page(args.out, raw, text, misses, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
