"""Streaming on a costed simulated GPU: a UNet's step time under budgets, with prefetch on and off, at a link
speed; prints one JSON line.

    .runtime/venv/bin/python -m tools.bench.streaming CHECKPOINT LINK LATENT [STEPS]
    # e.g. sd15.safetensors 25GB/s,10us,compute=10x 32

Run by ``tools/bench/run_all.py --only streaming``, a fresh process per checkpoint and link. The checkpoint is loaded
with the pack's own loader (fp32, so the host computes without converting), its UNet is placed by the pack's
engine on a simulated GPU whose copies take the link's time (``core.devices.sim.link``: latency + bytes over
bandwidth, a copy engine each way, side-stream copies overlapping the host's computation), and one sampling
step (a UNet forward, batch 2 as a sampler runs cond and uncond, at a ``LATENT`` x ``LATENT`` latent) is
timed ``STEPS`` times after a first step
that is not counted (it is the step prefetch learns the order from).

Per budget and setting it reports the bytes streamed per step, their copy time on the link (the transfer),
the step time, and the compute time (the step with everything resident). The floor is
``max(compute, transfer)``: a step cannot be faster than either.

``python -m tools.bench.streaming flux LINK LATENT [STEPS]`` measures row slices instead, on the small Flux of the
slicing work (FLUX.1-dev's layout cut to one double and one single block, hidden size 3072: 2.03 GiB in fp32,
layers of up to 264 MB), built from ComfyUI's own Flux class with seeded random fp32 weights, its standard layers
made cast layers as Move To GPU makes them. At each budget of :data:`FLUX_BUDGETS` it places the model twice,
prefetch on: streaming whole layers only (the plan before row slices: three of the largest streamed layer kept
for streaming) and with row slices (the plan's streaming unit), and times a step (one forward at a ``LATENT`` x
``LATENT`` latent, 64 text tokens) of each.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import time
from pathlib import Path

BUDGETS = (1.0, 0.5, 0.25, 0.1)
#: Budgets of the row-slice rows: two where streaming whole layers keeps some resident, and the issue's 600 MB.
FLUX_BUDGETS = (1536 * 1024**2, 1024 * 1024**2, 600 * 1024**2)


def _inputs(unet: object, width: int, latent: int, torch: object) -> tuple:
    """A batch of 2 (cond and uncond) at a ``latent`` square latent, with a ``width``-wide text context."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, latent, latent, generator=generator)
    context = torch.randn(2, 77, width, generator=generator)
    y = torch.randn(2, unet.label_emb[0][0].in_features, generator=generator) if unet.num_classes else None
    return x, torch.tensor([500.0, 500.0]), context, y


def measure(checkpoint: Path, link_text: str, latent: int, steps: int) -> dict:
    """Every budget, prefetch off and on, on one link; see the module's docstring."""
    from tools.runtime.inprocess import import_comfy, import_pack

    import_comfy()
    import folder_paths
    import torch

    folder_paths.add_model_folder_path("checkpoints", str(checkpoint.parent))
    pack = import_pack().__name__
    node = __import__(f"{pack}.nodes.load_checkpoint", fromlist=["x"])
    engines = __import__(f"{pack}.core.placement.engine", fromlist=["x"])
    prefetch = __import__(f"{pack}.core.placement.prefetch", fromlist=["x"])
    simulated = __import__(f"{pack}.core.devices.sim.device", fromlist=["x"])
    simcost = __import__(f"{pack}.core.devices.sim.cost", fromlist=["x"])
    tensors = __import__(f"{pack}.core.devices.tensors", fromlist=["x"])
    model = node.LoadCheckpointWithDevice.execute(checkpoint.name, "cpu", "cpu", "cpu", "fp32", "auto", "auto").args[0]
    unet = model.model.diffusion_model
    link = simcost.LinkCost.parse(link_text)
    device = simulated.SimulatedDevice(64 * 1024**3, link=link)
    engine = engines.partial_model_of(unet)
    total = engine.total_bytes()
    inputs = _inputs(unet, model.model.model_config.unet_config["context_dim"], latent, torch)
    results: dict = {"total": total, "link": link_text, "latent": latent, "rows": {}}
    with torch.inference_mode():
        for share in BUDGETS:
            for on in (False, True) if share < 1 else (True,):
                prefetch.use_prefetch(on)
                report = engine.load(device, int(total * share), fresh=True)
                placed = [device.place(t) if t is not None else None for t in inputs]
                times, moved, counted = [], [], []
                for _step in range(steps + 1):
                    before, copies_before = tensors.traffic(device).to_device, tensors.traffic(device).copies
                    started = time.perf_counter()
                    out = unet(placed[0], placed[1], placed[2], y=placed[3])
                    device.link.synchronize()
                    times.append(time.perf_counter() - started)
                    moved.append(tensors.traffic(device).to_device - before)
                    counted.append(tensors.traffic(device).copies - copies_before)
                    del out
                copies = int(statistics.median(counted[1:]))  # every copy a step makes: a layer's or a slice's
                nbytes = int(statistics.median(moved[1:]))
                results["rows"][f"{share}|{'on' if on else 'off'}"] = {
                    "resident": report.resident_bytes,
                    "streamed_layers": report.plan.streamed_layers,
                    "streamed_per_step": statistics.median(moved[1:]),
                    "transfer_s": link.seconds(nbytes) + max(0, copies - 1) * link.seconds(0),
                    "step_s": statistics.median(times[1:]),
                    "ahead": engine.ring.stats.ahead,
                    "on_demand": engine.ring.stats.copies - engine.ring.stats.ahead,
                }
                engine.unload_all()
                engine.ring.stats = type(engine.ring.stats)()
    results["compute_s"] = results["rows"]["1.0|on"]["step_s"]
    return results


def _flux(torch: object, pack: str) -> object:
    """The small Flux (see the module's docstring) with seeded fp32 weights, its standard layers cast layers."""
    import comfy.model_detection

    from tools.fixtures.layouts import layouts

    surface = __import__(f"{pack}.nodes.surface", fromlist=["x"])
    ops = __import__(f"{pack}.core.weights.ops", fromlist=["x"])
    real = layouts()["flux1_dev.diffusion_model.json"]["tensors"]
    later = re.compile(r"(double|single)_blocks\.[1-9]")
    cut = {k: torch.empty(shape, device="meta") for k, (shape, _dtype) in real.items() if not later.match(k)}
    model = comfy.model_detection.model_config_from_unet(cut, "").get_model({}, "")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, tensor in model.diffusion_model.state_dict().items():
            if tensor.dim() > 1:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.02)
            else:
                tensor.fill_(0.0 if name.endswith(".bias") else 1.0)
    standard = surface.standard_layer_classes()
    ops.convert(model.diffusion_model, accept=lambda cls: cls in standard)
    return model.diffusion_model


def measure_slices(link_text: str, latent: int, steps: int) -> dict:
    """Every budget of :data:`FLUX_BUDGETS`, whole layers and row slices, on one link; see the docstring."""
    from tools.runtime.inprocess import import_comfy, import_pack

    import_comfy()
    import torch

    pack = import_pack().__name__
    engines = __import__(f"{pack}.core.placement.engine", fromlist=["x"])
    streaming = __import__(f"{pack}.core.placement.streaming", fromlist=["x"])
    simulated = __import__(f"{pack}.core.devices.sim.device", fromlist=["x"])
    simcost = __import__(f"{pack}.core.devices.sim.cost", fromlist=["x"])
    tensors = __import__(f"{pack}.core.devices.tensors", fromlist=["x"])

    class WholeLayers(streaming.LayerHooks):
        """Every layer streams whole: the plan before row slices."""

        def slice_multiple(self, layer: object) -> None:
            return None

    unet = _flux(torch, pack)
    link = simcost.LinkCost.parse(link_text)
    device = simulated.SimulatedDevice(64 * 1024**3, link=link)
    engine = engines.partial_model_of(unet)
    generator = torch.Generator().manual_seed(1)
    inputs = (torch.randn(1, 16, latent, latent, generator=generator), torch.tensor([0.5]))
    extra = {"context": torch.randn(1, 64, 4096, generator=generator), "y": torch.randn(1, 768, generator=generator)}
    extra["guidance"] = torch.tensor([3.5])
    results: dict = {"total": engine.total_bytes(), "link": link_text, "latent": latent, "rows": {}}
    plans = [(engine.total_bytes(), "sliced")] + [(b, way) for b in FLUX_BUDGETS for way in ("whole", "sliced")]
    with torch.inference_mode():
        for budget, way in plans:
            hooks = WholeLayers() if way == "whole" else streaming.NO_HOOKS
            report = engine.load(device, budget, hooks=hooks, fresh=True)
            placed = [device.place(t) for t in inputs]
            named = {k: device.place(t) for k, t in extra.items()}
            times, moved, copies = [], [], []
            for _step in range(steps + 1):
                before = tensors.traffic(device)
                bytes_before, copies_before = before.to_device, before.copies
                started = time.perf_counter()
                out = unet(*placed, **named)
                device.link.synchronize()
                times.append(time.perf_counter() - started)
                moved.append(tensors.traffic(device).to_device - bytes_before)
                copies.append(tensors.traffic(device).copies - copies_before)
                del out
            nbytes, count = int(statistics.median(moved[1:])), int(statistics.median(copies[1:]))
            results["rows"][f"{budget}|{way}"] = {
                "resident": report.resident_bytes,
                "reserve": report.plan.reserve_bytes,
                "streamed_layers": report.plan.streamed_layers,
                "sliced_layers": len(report.plan.slices),
                "streamed_per_step": nbytes,
                "copies_per_step": count,
                "transfer_s": link.seconds(nbytes) + max(0, count - 1) * link.seconds(0),
                "step_s": statistics.median(times[1:]),
                "peak": device.peak_allocated(),
            }
            engine.unload_all()
            device.reset_peak()
    results["compute_s"] = results["rows"][f"{engine.total_bytes()}|sliced"]["step_s"]
    return results


def main() -> None:
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    if sys.argv[1] == "flux":
        result = measure_slices(sys.argv[2], int(sys.argv[3]), steps)
    else:
        result = measure(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), steps)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
