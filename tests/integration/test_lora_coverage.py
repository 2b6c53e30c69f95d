"""How much of a LoRA applies to a model: the bridge's count, by ComfyUI's key map, against ComfyUI's own loader.

The models are ComfyUI's SD1.5 and SDXL classes built on torch's ``meta`` device (a key map needs the module
tree, not its weights); the LoRAs are the layouts in ``tests/data`` (kohya, diffusers attention-processor and
PEFT namings, and two that ComfyUI does not fully map) and one in ComfyUI's own naming, made from its key map.
ComfyUI's answer is ``comfy.lora.load_lora``'s: the number of weights it patches.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from core.detection.lora_info import layer_names
from tools.fixtures.layouts import layouts

LORAS = sorted(name for name, layout in layouts().items() if layout["kind"] == "lora")
#: The base models' hyperparameters, as ComfyUI's detection reports them for the real files.
BASES = {"sd15": "sd15.checkpoint.json", "sdxl_base": "sdxl_base.checkpoint.json"}


@pytest.fixture(scope="module")
def comfy(comfy_runtime):
    from tools.runtime.inprocess import import_comfy, import_pack

    import_comfy()
    pack = import_pack()
    return (
        importlib.import_module("comfy.lora"),
        importlib.import_module("comfy.model_detection"),
        importlib.import_module("comfy.model_patcher").ModelPatcher,
        importlib.import_module(f"{pack.__name__}.nodes.bridge.lora_coverage"),
    )


@pytest.fixture(scope="module")
def models(comfy):
    """Per base model: ComfyUI's patchers of its diffusion model and its text encoder, built weightless."""
    _lora, detection, model_patcher, _coverage = comfy
    built = {}
    for base, file in BASES.items():
        layout = layouts()[file]
        sd = {name: torch.empty(shape, device="meta") for name, (shape, _dtype) in layout["tensors"].items()}
        with torch.device("meta"):
            config = detection.model_config_from_unet(sd, "model.diffusion_model.")
            model = config.get_model(sd, "model.diffusion_model.", device=torch.device("meta"))
            clip = config.clip_target(state_dict=sd).clip(device=torch.device("meta"), dtype=torch.float16)
        meta = torch.device("meta")
        built[base] = (model_patcher(model, meta, meta), model_patcher(clip, meta, meta))
    return built


def comfyui_patches(lora_module, names: list[str], patchers) -> int:
    """How many weights ComfyUI's own LoRA loader patches with a LoRA of these tensor names, on these models."""
    key_map: dict = {}
    lora_module.model_lora_keys_unet(patchers[0].model, key_map)
    lora_module.model_lora_keys_clip(patchers[1].model, key_map)
    tensors = {name: torch.ones(()) if name.endswith(".alpha") else torch.empty(1, device="meta") for name in names}
    return len(lora_module.load_lora(tensors, key_map, log_missing=False))


@pytest.mark.parametrize("name", LORAS)
def test_coverage_counts_what_comfyui_loads(comfy, models, name):
    lora_module, _detection, _patcher, bridge = comfy
    layout = layouts()[name]
    names = list(layout["tensors"])
    patchers = models[layout["base_model"]]
    layers = layer_names(names)
    ours = sum(bridge.coverage(layers, patcher).applied for patcher in patchers)
    assert ours == comfyui_patches(lora_module, names, patchers) == layout["comfy_detection"]["patched_weights"]
    if layout["comfy_detected"].startswith("NOT_FULLY_LOADED"):
        assert ours < len(layers)  # the negative cases: some layers ComfyUI does not map, and we say so
    else:
        assert ours == len(layers)


@pytest.mark.parametrize("base", sorted(BASES))
def test_coverage_of_a_lora_in_comfyui_s_own_naming(comfy, models, base):
    lora_module, _detection, _patcher, bridge = comfy
    patchers = models[base]
    own = [
        key
        for patcher in patchers
        for key in bridge.key_map(patcher)
        if key.startswith(("diffusion_model.", "text_encoders."))
    ]
    names = [f"{key}.{part}.weight" for key in own for part in ("lora_up", "lora_down")]
    ours = sum(bridge.coverage(layer_names(names), patcher).applied for patcher in patchers)
    assert ours == comfyui_patches(lora_module, names, patchers) == len(own) > 100


def test_a_lora_for_another_family_applies_nowhere_and_says_why(comfy, models):
    _lora, _detection, _patcher, bridge = comfy
    sdxl = layer_names(layouts()["lora_sdxl_kohya_r8_unet_only.json"]["tensors"])
    found = bridge.coverage(sdxl, models["sd15"][0])
    assert found.layers == len(sdxl) and found.applied < len(sdxl)
    text = bridge.Coverage(len(sdxl), 0).text("style_xl.safetensors", "SD15 diffusion model")
    assert "none of it applies" in text and "another model family" in text
