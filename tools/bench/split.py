"""One model across two costed simulated GPUs: the s/step of each way to run a model that one GPU cannot hold
whole, at a link speed; prints a markdown table (medians of ``--runs`` runs) and writes the raw runs as JSON.

    .runtime/venv/bin/python -m tools.bench.split CHECKPOINT [--links 25GB/s,10us,compute=10x 7GB/s,10us,compute=10x]
        [--runs 3] [--latent 32] [--steps 2] [--raw docs/bench/raw/split_sd15.json]

The checkpoint's UNet is loaded in fp32 by the pack's own loader and run as a sampler runs it (batch 2, a
``LATENT`` x ``LATENT`` latent) on simulated GPUs whose copies take the link's time (``core.devices.sim.link``;
``compute=10x`` makes every copy ten times as long, for a GPU ten times faster than this machine: divide all times
by ten for that GPU). A copy between the two simulated GPUs goes through host memory (two crossings, as between
consumer GPUs without peer access). Rows, each on GPUs that can hold half of the UNet:

* ``one device, everything resident``: the compute time (a GPU large enough; the pipeline's reference);
* ``one device, 50 % resident, casts on demand``: partial loading with every streamed layer copied when it is
  reached, nothing copied ahead: ComfyUI's low-VRAM mode does this, but its loader cannot drive a simulated GPU,
  so the pack's engine stands in for it (prefetch off);
* ``one device, 50 % resident, prefetch``: the pack's partial loading (Move To GPU under a budget);
* ``stream gpu:0=50%, cpu=*`` and ``stream gpu:0=50%, gpu:1=*`` with prefetch off and on;
* ``pipeline gpu:0=50%, gpu:1=*``: activations cross once per step each way, no weight moves.

Per row: GB moved per step (every byte that reached a device), the link's time for them (the transfer), the step,
the floor ``max(compute, transfer)`` and step / floor. The compute is the one-device step, measured first and
last in each run (the mean of the two); each run's step is divided by that run's floor, since this machine's
speed drifts from run to run. A link ending in ``compute=balanced`` (:data:`BALANCED`) sets the speed-up in each
run so that the transfer of half the model takes as long as the compute.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

#: Steps run before the timed ones: the prefetch learns the order of the layers in the first step, and that the
#: first layer follows the last when the second begins; the third is the first that starts with its first copies
#: queued ahead by the step before, as every later step of a sampler's twenty or so does.
WARM_UP = 2

#: A link written ``7GB/s,10us,compute=balanced`` computes as many times faster as makes half the model cross in
#: the time one step computes with it resident: the copies of the ``stream`` rows (about half the model) take about
#: as long as the computation, the hardest case for prefetch, whatever this machine's speed that day.
BALANCED = "compute=balanced"

ROWS = (
    ("one device, everything resident", "one", 1.0, True),
    ("one device, 50 % resident, casts on demand", "one", 0.5, False),
    ("one device, 50 % resident, prefetch", "one", 0.5, True),
    ("stream gpu:0=50%, cpu=*, prefetch off", "gpu:0=50%, cpu=*", "stream", False),
    ("stream gpu:0=50%, cpu=*, prefetch", "gpu:0=50%, cpu=*", "stream", True),
    ("stream gpu:0=50%, gpu:1=*, prefetch off", "gpu:0=50%, gpu:1=*", "stream", False),
    ("stream gpu:0=50%, gpu:1=*, prefetch", "gpu:0=50%, gpu:1=*", "stream", True),
    ("pipeline gpu:0=50%, gpu:1=*", "gpu:0=50%, gpu:1=*", "pipeline", True),
)


class Bench:
    """The loaded UNet, the pack's modules, and the inputs of one step."""

    def __init__(self, checkpoint: Path, latent: int) -> None:
        from tools.runtime.inprocess import import_comfy, import_pack

        import_comfy()
        import folder_paths
        import torch

        folder_paths.add_model_folder_path("checkpoints", str(checkpoint.parent))
        pack = import_pack().__name__
        self.torch = torch
        self.m = {
            name: __import__(f"{pack}.{name}", fromlist=["x"])
            for name in (
                "nodes.load_checkpoint",
                "core.placement.engine",
                "core.placement.prefetch",
                "core.placement.allocation",
                "core.placement.plan",
                "core.placement.split_model",
                "core.devices.sim.device",
                "core.devices.sim.cost",
                "core.devices.tensors",
                "nodes.bridge.splits",
                "nodes.bridge.split_moves",
            )
        }
        node = self.m["nodes.load_checkpoint"].LoadCheckpointWithDevice
        model = node.execute(checkpoint.name, "cpu", "cpu", "cpu", "fp32", "auto", "auto").args[0]
        self.unet = model.model.diffusion_model
        self.total = self.m["core.placement.engine"].partial_model_of(self.unet).total_bytes()
        generator = torch.Generator().manual_seed(0)
        width = model.model.model_config.unet_config["context_dim"]
        self.inputs = (
            torch.randn(2, 4, latent, latent, generator=generator),
            torch.tensor([500.0, 500.0]),
            torch.randn(2, 77, width, generator=generator),
        )

    def row(self, link_text: str, how: str, setting: Any, prefetch: bool, steps: int) -> dict[str, float]:
        """One row's step time and bytes moved per step (medians over ``steps`` after :data:`WARM_UP` steps)."""
        m = self.m
        link = m["core.devices.sim.cost"].LinkCost.parse(link_text)
        simulated = m["core.devices.sim.device"]
        gpus = [simulated.SimulatedDevice(64 * 1024**3, ordinal=i, link=link) for i in (0, 1)]
        m["core.placement.prefetch"].use_prefetch(prefetch)
        undo = self._place(how, setting, gpus)
        placed = [gpus[0].place(t) for t in self.inputs]
        traffic = m["core.devices.tensors"].traffic
        times, moved = [], []
        with self.torch.inference_mode():
            for _step in range(WARM_UP + steps):
                before = sum(traffic(g).to_device for g in gpus)
                started = time.perf_counter()
                out = self.unet(placed[0], placed[1], placed[2], transformer_options=self.options())
                for gpu in gpus:
                    gpu.link.synchronize()
                times.append(time.perf_counter() - started)
                moved.append(sum(traffic(g).to_device for g in gpus) - before)
                del out
        undo()
        nbytes = int(statistics.median(moved[WARM_UP:]))
        return {"step_s": statistics.median(times[WARM_UP:]), "moved": nbytes, "transfer_s": link.seconds(nbytes)}

    def rows(self, link_text: str, steps: int) -> dict[str, dict[str, float]]:
        """Every row at one link, in :data:`ROWS` order; the one-device row once more at the end, its step the mean
        of the two (``step_s_first``, ``step_s_last`` kept), so that every row has a reference taken about when it
        ran, on a machine whose speed drifts. A link ending in :data:`BALANCED` gets the speed-up that makes
        half the model cross in the first one-device step (``speedup`` kept)."""
        balanced = link_text.endswith(BALANCED)
        base = link_text[: -len(BALANCED)].rstrip(",") if balanced else link_text
        half = self.m["core.devices.sim.cost"].LinkCost.parse(base).seconds(self.total // 2)
        if balanced and half <= 0:
            raise SystemExit(f"{link_text!r}: a balanced link needs a bandwidth, e.g. 7GB/s,10us,{BALANCED}")
        name, how, setting, on = ROWS[0]
        cells = {name: self.row(base, how, setting, on, steps)}
        extra: dict[str, float] = {}
        if balanced:
            extra["speedup"] = max(1.0, cells[name]["step_s"] / half)
            link_text = f"{base},compute={extra['speedup']:.3f}x"
        for name, how, setting, on in ROWS[1:]:
            cells[name] = self.row(link_text, how, setting, on, steps)
        name, how, setting, on = ROWS[0]
        first, last = cells[name]["step_s"], self.row(link_text, how, setting, on, steps)["step_s"]
        cells[name].update(step_s=(first + last) / 2, step_s_first=first, step_s_last=last, **extra)
        return cells

    def options(self) -> dict[str, Any]:
        """ComfyUI's transformer options as the node sets them: a skip connection joins on the hidden state's
        device (``pipeline``; it changes nothing on one device)."""
        return {"patches": {"output_block_patch": [self.m["nodes.bridge.split_moves"].join_skip]}}

    def _place(self, how: str, setting: Any, gpus: list[Any]) -> Any:
        """Place the UNet for one row; returns what undoes it."""
        m = self.m
        if how == "one":
            engine = m["core.placement.engine"].partial_model_of(self.unet)
            engine.load(gpus[0], int(self.total * setting), fresh=True)
            return engine.unload_all
        split_model = m["core.placement.split_model"]
        layers = m["core.placement.plan"].layers_of(self.unet)
        allocation = m["core.placement.allocation"].parse_allocation(how)
        request = split_model.SplitRequest(self.unet, (self.unet,), layers, allocation, setting, gpus[0])
        targets = {"gpu:0": gpus[0], "gpu:1": gpus[1], "cpu": m["core.devices.tensors"].HOST}
        held = split_model.load_split(request, split_model.plan_split(request), targets)
        return held.release


def table(runs: list[dict[str, Any]]) -> str:
    """The markdown table of the medians (ranges in brackets) of every row and link."""
    lines = [
        "| link | row | moved per step | transfer | step | floor max(compute, transfer) | step / floor |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for link in runs[0]["links"]:
        speedups = [run["links"][link][ROWS[0][0]].get("speedup") for run in runs]
        label = link if None in speedups else f"{link} ({statistics.median(speedups):.1f}x)"
        for name, *_ in ROWS:
            cells = [run["links"][link][name] for run in runs]
            step = [c["step_s"] for c in cells]
            moved = statistics.median(c["moved"] for c in cells) / 1024**3
            transfer = statistics.median(c["transfer_s"] for c in cells)
            # Each run's step over its own floor: the one-device step of the same run, so a run the machine
            # computed more slowly in is compared with its own compute.
            computes = [run["links"][link][ROWS[0][0]]["step_s"] for run in runs]
            floors = [max(compute, c["transfer_s"]) for compute, c in zip(computes, cells, strict=True)]
            floor = statistics.median(floors)
            ratio = [s / f for s, f in zip(step, floors, strict=True)]
            lines.append(
                f"| {label} | {name} | {moved:.2f} GiB | {transfer:.2f} s | {statistics.median(step):.2f} s "
                f"({min(step):.2f}-{max(step):.2f}) | {floor:.2f} s | {statistics.median(ratio):.2f}x "
                f"({min(ratio):.2f}-{max(ratio):.2f}) |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--links", nargs="+", default=["25GB/s,10us,compute=10x", "7GB/s,10us,compute=10x"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--latent", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--raw", type=Path, default=None, help="where to write the raw runs (JSON)")
    args = parser.parse_args(argv)
    bench = Bench(args.checkpoint, args.latent)
    runs = [{"links": {link: bench.rows(link, args.steps) for link in args.links}} for _run in range(args.runs)]
    if args.raw is not None:
        args.raw.parent.mkdir(parents=True, exist_ok=True)
        args.raw.write_text(json.dumps({"total_bytes": bench.total, "latent": args.latent, "runs": runs}, indent=1))
    sys.stdout.write(table(runs) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
