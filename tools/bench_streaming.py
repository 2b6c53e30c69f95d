"""Streaming on a costed simulated GPU: a UNet's step time under budgets, with prefetch on and off, at a link
speed; prints one JSON line.

    .runtime/venv/bin/python -m tools.bench_streaming CHECKPOINT LINK LATENT [STEPS]
    # e.g. sd15.safetensors 25GB/s,10us,compute=10x 32

Run by ``tools/bench.py --only streaming``, a fresh process per checkpoint and link. The checkpoint is loaded
with the pack's own loader (fp32, so the host computes without converting), its UNet is placed by the pack's
engine on a simulated GPU whose copies take the link's time (``core.devices.simlink``: latency + bytes over
bandwidth, a copy engine each way, side-stream copies overlapping the host's computation), and one sampling
step (a UNet forward, batch 2 as a sampler runs cond and uncond, at a ``LATENT`` x ``LATENT`` latent) is
timed ``STEPS`` times after a first step
that is not counted (it is the step prefetch learns the order from).

Per budget and setting it reports the bytes streamed per step, their copy time on the link (the transfer),
the step time, and the compute time (the step with everything resident). The floor is
``max(compute, transfer)``: a step cannot be faster than either.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

BUDGETS = (1.0, 0.5, 0.25, 0.1)


def _inputs(unet: object, width: int, latent: int, torch: object) -> tuple:
    """A batch of 2 (cond and uncond) at a ``latent`` square latent, with a ``width``-wide text context."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, latent, latent, generator=generator)
    context = torch.randn(2, 77, width, generator=generator)
    y = torch.randn(2, unet.label_emb[0][0].in_features, generator=generator) if unet.num_classes else None
    return x, torch.tensor([500.0, 500.0]), context, y


def measure(checkpoint: Path, link_text: str, latent: int, steps: int) -> dict:
    """Every budget, prefetch off and on, on one link; see the module's docstring."""
    from tools.comfy_inprocess import import_comfy, import_pack

    import_comfy()
    import folder_paths
    import torch

    folder_paths.add_model_folder_path("checkpoints", str(checkpoint.parent))
    pack = import_pack().__name__
    node = __import__(f"{pack}.nodes.load_checkpoint", fromlist=["x"])
    engines = __import__(f"{pack}.core.placement.engine", fromlist=["x"])
    prefetch = __import__(f"{pack}.core.placement.prefetch", fromlist=["x"])
    simulated = __import__(f"{pack}.core.devices.simulated", fromlist=["x"])
    simlink = __import__(f"{pack}.core.devices.simlink", fromlist=["x"])
    tensors = __import__(f"{pack}.core.devices.tensors", fromlist=["x"])
    model = node.LoadCheckpointWithDevice.execute(checkpoint.name, "cpu", "cpu", "cpu", "fp32", "auto", "auto").args[0]
    unet = model.model.diffusion_model
    link = simlink.LinkCost.parse(link_text)
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
                times, moved = [], []
                for _step in range(steps + 1):
                    before = tensors.traffic(device).to_device
                    started = time.perf_counter()
                    out = unet(placed[0], placed[1], placed[2], y=placed[3])
                    device.link.synchronize()
                    times.append(time.perf_counter() - started)
                    moved.append(tensors.traffic(device).to_device - before)
                    del out
                copies = sum(1 for layer in engine.streamed_layers() for _ in _weights(layer.module))
                results["rows"][f"{share}|{'on' if on else 'off'}"] = {
                    "resident": report.resident_bytes,
                    "streamed_layers": report.plan.streamed_layers,
                    "streamed_per_step": statistics.median(moved[1:]),
                    "transfer_s": link.seconds(int(statistics.median(moved[1:]))) + (copies - 1) * link.seconds(0),
                    "step_s": statistics.median(times[1:]),
                    "ahead": engine.lookahead.stats.ahead,
                    "on_demand": engine.lookahead.stats.on_demand,
                }
                engine.unload_all()
                engine.lookahead.stats = prefetch.PrefetchStats()
    results["compute_s"] = results["rows"]["1.0|on"]["step_s"]
    return results


def _weights(module: object) -> list:
    return [t for t in (getattr(module, "weight", None), getattr(module, "bias", None)) if t is not None]


def main() -> None:
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    sys.stdout.write(json.dumps(measure(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), steps)) + "\n")


if __name__ == "__main__":
    main()
