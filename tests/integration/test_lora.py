"""LoRA through our loader and our patching: the same image as ComfyUI's own loader and LoraLoader, with the
UNet resident and with half of it streaming from RAM on a simulated GPU (LoRA applied on the fly there);
and an exact restore of every weight after patching."""

from __future__ import annotations

import gc
import importlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.passes import EVERY_VERSION
from tools.fixtures.make import SD15_CHECKPOINT
from tools.runtime.server import ComfyError
from tools.templates.workflow_api import load_workflow, ui_to_api

REPO = Path(__file__).resolve().parents[2]
#: Several full-size models at once (the hook LoRA's stock graph held 11.7 GB in its server, killed for memory
#: beside another tier's module): runs while no other tier's module does (tests/server_pool.py).
HOLDS_MODELS = True
LORA_WORKFLOW = REPO / "workflows" / "06 SD1.5 - a LoRA on a UNet placed on the GPU.json"


@pytest.fixture(scope="module")
def small_gpu_server(servers):
    """A simulated 2 GiB GPU: the 3.2 GiB fp32 UNet must stream about half of itself."""
    return servers("lora-sim", SIMULATE_GPU="2GiB")


@pytest.fixture(scope="module")
def prompts(small_gpu_server):
    ours = ui_to_api(load_workflow(LORA_WORKFLOW), small_gpu_server.get("/object_info"))
    stock = json.loads(json.dumps(ours))
    stock["1"] = {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": SD15_CHECKPOINT}}
    return stock, ours


def with_inputs(prompt: dict, node: str, **inputs) -> dict:
    changed = json.loads(json.dumps(prompt))
    changed[node]["inputs"].update(inputs)
    return changed


@EVERY_VERSION  # how ComfyUI patches a model it streams changes between versions
def test_lora_resident_and_half_streamed_give_comfyuis_image(small_gpu_server, prompts, api):
    stock, ours = prompts
    expected = api.image_of(small_gpu_server, small_gpu_server.run(stock))
    resident = small_gpu_server.run(with_inputs(ours, "1", model_device="cpu"))
    assert np.array_equal(api.image_of(small_gpu_server, resident), expected)
    streamed = small_gpu_server.run(ours)
    assert np.array_equal(api.image_of(small_gpu_server, streamed), expected)
    unet = next(m for m in api.report_json(streamed, "7")["models"] if m["component"] == "MODEL")
    on_gpu = unet["resident"]["gpu:0"]
    assert unet["partial"] and 0.3 < on_gpu / unet["total_bytes"] < 0.7  # about half streamed
    loads = re.findall(
        r"loaded SD15 diffusion model: .* streamed .*; on-the-fly patches: (\d+)", small_gpu_server.log_tail(400)
    )
    assert loads and int(loads[-1]) > 0  # the LoRA was applied on the fly to the streamed layers
    log = small_gpu_server.log_tail(600)  # how much of the LoRA each model takes, by ComfyUI's own key maps
    assert "LoRA 'device_control_sd15_lora_r4.safetensors' patches 128 of its 200 layers in SD15 diffusion model" in log
    assert "patches 72 of its 200 layers in text encoder (SD1ClipModel)" in log
    no_lora = small_gpu_server.run(
        with_inputs(with_inputs(ours, "11", strength_model=0.0, strength_clip=0.0), "1", model_device="cpu")
    )
    assert not np.array_equal(api.image_of(small_gpu_server, no_lora), expected)  # the LoRA does change the image


#: A rank-1 LoRA over every weight of the SD1.5 UNet (kohya naming): whichever layers a step's first copies
#: ahead are, a hook made of it changes them.
EVERY_LAYER_LORA = "device_control_sd15_every_unet_layer_r1.safetensors"


def make_every_layer_lora(synthetic_models: dict[str, Path]) -> str:
    """Write :data:`EVERY_LAYER_LORA` beside the synthetic LoRA (from the checkpoint's header, seeded); its name."""
    prefix = "model.diffusion_model."
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    with safe_open(str(synthetic_models["checkpoint"]), "pt") as handle:
        for key in handle.keys():  # noqa: SIM118 (not a dict)
            shape = handle.get_slice(key).get_shape()
            if not key.startswith(prefix) or not key.endswith(".weight") or len(shape) not in (2, 4):
                continue
            name = "lora_unet_" + key[len(prefix) : -len(".weight")].replace(".", "_")
            down, up = (1, *shape[1:]), (shape[0], 1, *([1, 1] if len(shape) == 4 else []))
            tensors[f"{name}.lora_down.weight"] = torch.randn(down, generator=generator) * 0.05
            tensors[f"{name}.lora_up.weight"] = torch.randn(up, generator=generator) * 0.05
    save_file(tensors, str(synthetic_models["lora"].with_name(EVERY_LAYER_LORA)))
    return EVERY_LAYER_LORA


def hooked(prompt: dict, lora: str, strength: float) -> dict:
    """``prompt`` with ``lora`` as a ComfyUI hook on the positive prompt only (Create Hook LoRA, Cond Set Props)
    instead of LoraLoader, sampled two steps at cfg 2: each step then runs the model twice, the positive with
    the hook's weights written into the model and the negative with them taken out again (ComfyUI writes the
    weights in place between the two calls), and the second step writes them in again after the first's negative
    (every switch rewrites the whole UNet on this CPU: two steps are the fewest with both directions)."""
    changed = json.loads(json.dumps(prompt))
    del changed["11"]
    changed["2"]["inputs"]["value"] = ["1", 0]
    changed["3"]["inputs"]["clip"] = changed["4"]["inputs"]["clip"] = ["1", 1]
    changed["20"] = {
        "class_type": "CreateHookLora",
        "inputs": {"lora_name": lora, "strength_model": strength, "strength_clip": 0.0},
    }
    changed["21"] = {
        "class_type": "ConditioningSetProperties",
        "inputs": {"cond_NEW": ["3", 0], "strength": 1.0, "set_cond_area": "default", "hooks": ["20", 0]},
    }
    changed["6"]["inputs"].update(positive=["21", 0], steps=2, cfg=2.0)
    return changed


def test_a_hook_lora_on_one_prompt_gives_comfyuis_image_with_half_the_unet_streamed(
    small_gpu_server, prompts, api, synthetic_models
):
    """A copy queued ahead must never outlive a weight ComfyUI rewrites in place: the hook's weights go in before
    the positive's call and out before the negative's, every step, while the prefetch copies the next call's first
    layers during the last layers of the call before."""
    stock, ours = prompts
    lora = make_every_layer_lora(synthetic_models)
    expected = api.image_of(small_gpu_server, small_gpu_server.run(hooked(stock, lora, 1.0)))
    streamed = small_gpu_server.run(hooked(ours, lora, 1.0))
    unet = next(m for m in api.report_json(streamed, "7")["models"] if m["component"] == "MODEL")
    assert unet["partial"] and 0.3 < unet["resident"]["gpu:0"] / unet["total_bytes"] < 0.7  # about half streamed
    assert np.array_equal(api.image_of(small_gpu_server, streamed), expected)
    without = small_gpu_server.run(hooked(ours, lora, 0.0))
    assert not np.array_equal(api.image_of(small_gpu_server, without), expected)  # the hook does change the image


def test_a_lora_with_nan_values_is_refused_when_added_naming_the_file(small_gpu_server, prompts, api, synthetic_models):
    """ComfyUI's own LoRA loader adding a damaged LoRA to a model Device Control loaded: the LoRA node fails at
    once, naming the file and a weight, instead of sampling a black image; the server keeps serving."""
    _stock, ours = prompts
    broken = synthetic_models["lora"].with_name("device_control_broken_nan.safetensors")
    with safe_open(str(synthetic_models["lora"]), "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
    first_down = sorted(name for name in tensors if name.endswith("lora_down.weight"))[0]
    tensors[first_down] = torch.full_like(tensors[first_down], float("nan"))
    save_file(tensors, str(broken))
    try:
        prompt = with_inputs(ours, "11", lora_name=broken.name)
        with pytest.raises(ComfyError, match=r"LoRA 'device_control_broken_nan.safetensors' has NaN .* the file is"):
            small_gpu_server.run(prompt)
    finally:
        broken.unlink()
    entry = small_gpu_server.run(ours)  # the next prompt works
    assert api.image_of(small_gpu_server, entry).std() > 1.0


@pytest.fixture(scope="module")
def comfy(comfy_runtime, synthetic_models):
    from tools.runtime.inprocess import import_comfy, import_pack

    mm = import_comfy()
    folder_paths = importlib.import_module("folder_paths")
    folder_paths.add_model_folder_path("checkpoints", str(synthetic_models["checkpoint"].parent))
    node = importlib.import_module(f"{import_pack().__name__}.nodes.load_checkpoint")
    yield mm, node, synthetic_models["lora"]
    mm.unload_all_models()
    gc.collect()


def test_patching_equals_comfyui_and_restores_every_weight_exactly(comfy):
    mm, node, lora_path = comfy
    comfy_sd, comfy_utils = importlib.import_module("comfy.sd"), importlib.import_module("comfy.utils")
    comfy_lora, comfy_float = importlib.import_module("comfy.lora"), importlib.import_module("comfy.float")
    model, clip, _vae, _ = node.LoadCheckpointWithDevice.execute(
        SD15_CHECKPOINT, "cpu", "cpu", "cpu", "fp16", "auto", "auto"
    ).args
    patched_model, _ = comfy_sd.load_lora_for_models(model, clip, comfy_utils.load_torch_file(str(lora_path)), 0.8, 1.0)
    assert type(patched_model).__name__ == "DeviceControlPatcher" and len(patched_model.patches) == 128
    before = {k: v.detach().clone() for k, v in model.model.diffusion_model.state_dict().items()}
    # Asked for one patched weight (newer ComfyUI does, to save a checkpoint): it is given, nothing changes.
    key = next(iter(patched_model.patches))
    given = patched_model.patch_weight_to_device(key, return_weight=True)
    expected = comfy_lora.calculate_weight(
        patched_model.patches[key], before[key.removeprefix("diffusion_model.")].to(torch.float32), key
    )
    assert given.dtype == torch.float16 and torch.allclose(given.float(), expected, atol=2e-3)
    assert torch.equal(dict(patched_model.model.named_parameters())[key], before[key.removeprefix("diffusion_model.")])
    assert key not in patched_model.backup
    unpatched = "diffusion_model.out.2.bias"
    assert unpatched not in patched_model.patches
    assert (
        patched_model.patch_weight_to_device(unpatched, return_weight=True)
        is dict(patched_model.model.named_parameters())[unpatched]
    )
    mm.load_models_gpu([patched_model])  # as a sampler does: ComfyUI patches the weights through our patcher
    unet = patched_model.model
    for key, patches in patched_model.patches.items():
        original = before[key.removeprefix("diffusion_model.")]
        reference = comfy_lora.calculate_weight(patches, original.to(torch.float32), key)
        reference = comfy_float.stochastic_rounding(reference, original.dtype, seed=0)
        ours = dict(unet.named_parameters())[key]
        assert ours.dtype == torch.float16 and torch.equal(ours, reference), key
    mm.unload_all_models()  # ComfyUI unpatches from its backups
    after = unet.diffusion_model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # bit for bit, every weight
    del patched_model, model, clip, before
    mm.unload_all_models()
    gc.collect()
