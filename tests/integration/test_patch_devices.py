"""The queue-time reading of where a model patch or GLIGEN computes (``nodes.patch_devices``), on prompts as the
frontend sends them: what it refuses is refused over HTTP in ``test_move_model_types.py``; here, what it must let
run (the same device, ``auto``, a model whose placement the prompt does not say) and how far it follows a wire."""

from __future__ import annotations

import importlib

import pytest


@pytest.fixture(scope="module")
def problems(comfy_runtime):
    from tools.runtime.inprocess import import_pack

    return importlib.import_module(f"{import_pack().__name__}.nodes.patch_devices").patch_device_problems


def node(kind: str, **inputs) -> dict:
    return {"class_type": kind, "inputs": inputs}


def graph(patch_device: str, model_device: str, *, between: str | None = None) -> dict:
    """A checkpoint's model placed on ``model_device`` (through ``between``, a node of that type, if given), GLIGEN
    placed on ``patch_device``, its box reaching the sampler through the conditioning."""
    prompt = {
        "1": node("DeviceControl_LoadCheckpoint", ckpt_name="x", model_device="cpu", clip_device="cpu"),
        "2": node("DeviceControl_MoveToGPU", model=["1", 0], device=model_device, vram_budget="all"),
        "3": node("GLIGENLoader", gligen_name="g"),
        "4": node("DeviceControl_MoveToGPU", model=["3", 0], device=patch_device, vram_budget="all"),
        "5": node("DeviceControl_VRAMReport", value=["4", 0]),
        "6": node("CLIPTextEncode", clip=["1", 1], text="a cat"),
        "7": node("GLIGENTextBoxApply", conditioning_to=["6", 0], clip=["1", 1], gligen_textbox_model=["5", 0]),
        "8": node("KSampler", model=["2", 0], positive=["7", 0], negative=["6", 0]),
    }
    if between:
        prompt["9"] = node(between, model=["2", 0])
        prompt["8"]["inputs"]["model"] = ["9", 0]
    return prompt


def test_gligen_on_another_gpu_than_its_sampler_is_refused_on_its_move(problems):
    found = problems(graph("gpu:1", "gpu:0"))
    assert list(found) == ["4"] and "GLIGEN model is placed on gpu:1" in found["4"]


@pytest.mark.parametrize(
    ("patch", "model", "between"),
    [
        ("gpu:1", "gpu:1", None),
        ("cuda:1", "gpu:1", None),  # two names of one device
        ("auto", "gpu:0", None),
        ("gpu:1", "auto", None),
        ("gpu:1", "gpu:0", "LoraLoaderModelOnly"),  # a node between that the check does not read through
    ],
)
def test_what_the_prompt_does_not_show_apart_runs(problems, patch, model, between):
    assert problems(graph(patch, model, between=between)) == {}


def test_the_loaders_device_counts_where_no_move_follows(problems):
    prompt = graph("gpu:1", "gpu:0")
    prompt["8"]["inputs"]["model"] = ["1", 0]
    prompt["1"]["inputs"]["model_device"] = "gpu:0"
    assert list(problems(prompt)) == ["4"]
    prompt["1"]["inputs"]["model_device"] = "gpu:1"
    assert problems(prompt) == {}


def test_a_patch_moved_again_offloaded_and_followed_by_a_models_move_is_checked_where_it_computes(problems):
    """GLIGEN on gpu:1, then moved to gpu:0 and offloaded, the diffusion model's move ordered after the offload (its
    trigger): neither the second move nor Offload To CPU is a diffusion model, and a trigger carries no patch."""
    prompt = graph("gpu:1", "gpu:0")
    prompt["9"] = node("DeviceControl_MoveToGPU", model=["4", 0], device="gpu:0", vram_budget="all")
    prompt["5"]["inputs"]["value"] = ["9", 0]
    prompt["10"] = node("DeviceControl_OffloadToCPU", model=["5", 0], mode="full")
    prompt["2"]["inputs"]["trigger"] = ["10", 0]
    assert problems(prompt) == {}  # it computes on gpu:0, where the sampler's model is
    prompt["9"]["inputs"]["device"] = "gpu:1"
    assert list(problems(prompt)) == ["9"]
