"""The budget is an invariant: one SD1.5 UNet walked through bigger and smaller budgets, an offload, a stock run, a
LoRA added and removed, never holds more of the simulated GPU than the budget it was last placed with.

What the model holds on the device is read from the device's own books, not from what the engine says it placed:
ComfyUI runs on the CPU here and the text encoder and the VAE stay in RAM, so the simulated GPU holds this UNet
alone (checked at every report) and, while it samples, its activations. Between nodes nothing computes: the
device's allocation is the model's bytes (resident weights, and a ring or staging buffer left behind if any).
While it samples, the device's peak (exact: ``DEVICE_CONTROL_PEAKS=reset``, each VRAM Report starts it again)
less the activations is its peak: resident weights, ring slots, staging and dequantisation temporaries. The
activations are measured once, on the same latent, with the whole model resident (so nothing streams and nothing is
cast): the peak of that sampling above the allocation before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from core.units import format_bytes, parse_size
from tests.passes import ONCE

REPO = Path(__file__).resolve().parents[2]
MOVE = REPO / "workflows" / "01 Start here - SD1.5 moved to the GPU, then offloaded.json"
LORA = "device_control_sd15_lora_r4.safetensors"
#: Report nodes the walk reads: after Move To GPU (the workflow's), after the sampler, after Offload To CPU.
AFTER_MOVE, AFTER_SAMPLER, AFTER_OFFLOAD = "4", "14", "10"

pytestmark = ONCE  # our engine's books over ComfyUI calls the version checks cover


@pytest.fixture(scope="module")
def server(servers):
    return servers("budget-8g", SIMULATE_GPU="8GiB", PEAKS="reset")


def step(server, api, budget: str, *, offload: bool = False, lora: bool = False) -> dict:
    """The starter workflow with its UNet moved under ``budget``, sampled, a report after the sampler, then
    (``offload``) Offload To CPU and a report; the LoRA fixture on the UNet before the move (``lora``). The VAE
    decode is left out: the UNet is what the walk watches."""
    prompt = api.load_prompt(server, MOVE)
    for node in ("11", "12", "13"):
        del prompt[node]
    prompt["3"]["inputs"]["vram_budget"] = budget
    prompt[AFTER_SAMPLER] = {
        "class_type": "DeviceControl_VRAMReport",
        "inputs": {"label": "after the sampler", "devices": "all", "value": ["8", 0]},
    }
    if offload:
        prompt["9"]["inputs"]["trigger"] = [AFTER_SAMPLER, 0]
    else:
        del prompt["9"], prompt[AFTER_OFFLOAD]
    if lora:
        prompt["20"] = {
            "class_type": "LoraLoaderModelOnly",
            "inputs": {"model": prompt["3"]["inputs"]["model"], "lora_name": LORA, "strength_model": 1.0},
        }
        prompt["3"]["inputs"]["model"] = ["20", 0]
    return server.run(prompt)


def device(api, entry: dict, node: str) -> dict:
    """The simulated GPU's line of a report, after checking that nothing but the UNet under Device Control is on
    it (so its allocation is that model's and the activations')."""
    report = api.report_json(entry, node)
    on_gpu = [m for m in report["models"] if m["resident"].get("gpu:0")]
    assert all(m["component"] == "MODEL" and m["managed_by"] == "Device Control" for m in on_gpu), on_gpu
    return next(d for d in report["devices"] if d["id"] == "gpu:0")


@dataclass
class Walk:
    """What the walk measured: the activations of one sampling, and each figure beside the budget it must keep to,
    by kind (``between nodes``: after a move, after sampling, during a move; ``sampling``: the sampler's peak less
    the activations)."""

    activations: int = 0
    figures: dict[str, list[tuple[str, int, int]]] = field(default_factory=lambda: {"between": [], "sampling": []})

    def record(self, api, entry: dict, name: str, budget: str, before: str | None, *, offload: bool = False) -> None:
        """One step: the move's peak within the larger of the budget before and this one (the old placement holds
        until the move frees it), the model's bytes after the move and after sampling within this budget, and at the
        sampler's peak less the activations; nothing after a full offload."""
        limit = parse_size(budget)
        moved, sampled = device(api, entry, AFTER_MOVE), device(api, entry, AFTER_SAMPLER)
        between = self.figures["between"]
        between.append((f"{name}: during the move", moved["peak_allocated"], max(limit, parse_size(before or budget))))
        between.append((f"{name}: after the move", moved["torch_allocated"], limit))
        between.append((f"{name}: after sampling", sampled["torch_allocated"], limit))
        if offload:
            between.append((f"{name}: after Offload To CPU", device(api, entry, AFTER_OFFLOAD)["torch_allocated"], 0))
        self.figures["sampling"].append((f"{name}: sampling", sampled["peak_allocated"] - self.activations, limit))

    def over(self, kind: str) -> str:
        """The figures of ``kind`` over their budget, one a line (empty when none)."""
        return "\n".join(
            f"{what}: {format_bytes(held)} on the device, budget {format_bytes(budget)}"
            for what, held, budget in self.figures[kind]
            if held > budget
        )


@pytest.fixture(scope="module")
def walk(server, api) -> Walk:
    """One UNet, from the same loader throughout, walked through the budgets."""
    walk = Walk()
    # The activations of one sampling on this latent: the whole UNet resident, nothing streamed or cast.
    whole = step(server, api, "all")
    walk.activations = device(api, whole, AFTER_SAMPLER)["peak_allocated"]
    walk.activations -= device(api, whole, AFTER_MOVE)["torch_allocated"]
    walk.record(api, step(server, api, "1GB"), "1GB", "1GB", "8GiB")
    # The path of hazard 10 of issue 50: a smaller budget after a larger one, then Offload To CPU after the sampler.
    walk.record(api, step(server, api, "600MB", offload=True), "600MB after 1GB", "600MB", "1GB", offload=True)
    walk.record(api, step(server, api, "1.5GB"), "1.5GB after an offload", "1.5GB", None)
    server.run(api.stock_equivalent(api.load_prompt(server, MOVE)))  # ComfyUI's own nodes, a model of its own
    walk.record(api, step(server, api, "1GB", lora=True), "1GB with a LoRA", "1GB", "1.5GB")
    walk.record(api, step(server, api, "1GB"), "1GB, the LoRA removed", "1GB", "1GB")
    walk.record(api, step(server, api, "600MB"), "600MB at the end", "600MB", "1GB")
    return walk


def test_the_activations_are_those_of_a_small_latent(walk):
    assert 0 < walk.activations < 64 * 1024**2, format_bytes(walk.activations)  # 64x64 pixels, one step


def test_between_nodes_the_model_holds_no_more_than_its_budget(walk):
    assert not walk.over("between"), "over budget:\n" + walk.over("between")


def test_while_it_samples_the_model_holds_no_more_than_its_budget(walk):
    assert not walk.over("sampling"), "over budget:\n" + walk.over("sampling")
