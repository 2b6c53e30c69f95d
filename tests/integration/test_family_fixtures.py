"""The family fixtures (SDXL, SD3.5, Flux, Chroma, Wan 2.1, their LoRAs, text encoders, VAEs) on this ComfyUI.

The files are made once and cached, possibly by another ComfyUI version; the suite runs this module once per
version, so each check here is this ComfyUI's own verdict: its detection names each diffusion model's class and
would load every tensor, its LoRA loader maps every LoRA key, its text-encoder loader takes CLIP-G with no key
missing, and its VAE builds each VAE and decodes a latent. Diffusion models are read from their headers only.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
from functools import cache

import pytest
import torch
from safetensors.torch import load_file

from tools.fixtures.families import CONDITIONING, DIFFUSION_FIXTURES
from tools.fixtures.family_parts import SPARSE_TEXT_ENCODERS, VAE_CLASSES
from tools.fixtures.files import file_on_meta, same_shapes
from tools.runtime.inprocess import import_comfy

#: Where each diffusion model takes its text: (tensor, dimension) of its per-token input and of its pooled input.
TEXT_INPUTS = {
    "sdxl_unet": (("input_blocks.4.1.transformer_blocks.0.attn2.to_k.weight", 1), ("label_emb.0.0.weight", 1)),
    "sd35": (("context_embedder.weight", 1), ("y_embedder.mlp.0.weight", 1)),
    "flux": (("txt_in.weight", 1), ("vector_in.in_layer.weight", 1)),
    "chroma": (("txt_in.weight", 1), None),
    "wan21": (("text_embedding.0.weight", 1), None),
}
#: SDXL's pooled input also carries six 256-wide size and crop embeddings.
EXTRA_POOLED = {"sdxl_unet": 6 * 256}


def _comfy(module: str):
    import_comfy()
    return importlib.import_module(module)


@cache
def _detected(path: str) -> tuple[object, object, dict[str, torch.Tensor]]:
    """This ComfyUI's config for a diffusion model file (header only), its model built on meta, and the header."""
    detection = _comfy("comfy.model_detection")
    written = file_on_meta(path)
    config = detection.model_config_from_unet(written, "")
    assert config is not None, f"this ComfyUI does not recognise {path}"
    with torch.device("meta"):
        model = config.get_model(written, "", device=torch.device("meta"))
    return config, model, written


@pytest.mark.parametrize("key", sorted(DIFFUSION_FIXTURES))
def test_each_diffusion_model_is_detected_as_its_family_and_loads_whole(synthetic_models, key):
    fixture = DIFFUSION_FIXTURES[key]
    config, model, written = _detected(str(synthetic_models[key]))
    assert type(config).__name__ == fixture.comfy_class
    # What this ComfyUI's loader would do with the file's tensors: every model tensor is there, none is left over.
    assert same_shapes(config.process_unet_state_dict(dict(written)), model.diffusion_model.state_dict()) == []
    assert {str(t.dtype) for t in written.values()} == {"torch.float16"}


@pytest.mark.parametrize("key", sorted(DIFFUSION_FIXTURES))
def test_the_recorded_conditioning_is_what_each_model_takes(synthetic_models, key):
    _config, _model, written = _detected(str(synthetic_models[key]))
    (context, context_dim), pooled = TEXT_INPUTS[key]
    assert written[context].shape[context_dim] == CONDITIONING[key].context_dim
    if pooled is None:
        assert CONDITIONING[key].pooled_dim is None
    else:
        width = CONDITIONING[key].pooled_dim + EXTRA_POOLED.get(key, 0)
        assert written[pooled[0]].shape[pooled[1]] == width


@pytest.mark.parametrize("key", sorted(DIFFUSION_FIXTURES))
def test_each_lora_maps_every_key_onto_the_attention_and_mlp_linears(synthetic_models, key):
    lora = _comfy("comfy.lora")
    fixture = DIFFUSION_FIXTURES[key]
    _config, model, _written = _detected(str(synthetic_models[key]))
    tensors = load_file(str(synthetic_models[fixture.lora_key]))
    key_map = lora.model_lora_keys_unet(model, {})
    patches = lora.load_lora(tensors, key_map, log_missing=False)
    assert len(patches) * 3 == len(tensors)  # down, up and alpha of every layer
    linears = {
        f"diffusion_model.{name}"
        for name, weight in model.diffusion_model.state_dict().items()
        if weight.dim() == 2 and re.search(fixture.lora_modules, name.removesuffix(".weight"))
    }
    assert set(patches) == linears


def _missing_clip_keys(caplog: pytest.LogCaptureFixture, paths: list[str], clip_type: str) -> tuple[str, list[str]]:
    """Load text encoder files with this ComfyUI's ``load_clip``; return the class it built and the keys it missed."""
    sd = _comfy("comfy.sd")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        clip = sd.load_clip(ckpt_paths=paths, clip_type=getattr(sd.CLIPType, clip_type))
    missing = [r.getMessage() for r in caplog.records if r.getMessage().startswith("clip missing")]
    return type(clip.cond_stage_model).__name__, missing


@pytest.mark.slow
def test_clip_g_loads_for_sdxl_with_clip_l_and_for_sd3_alone(synthetic_models, caplog):
    sd = _comfy("comfy.sd")
    clip_g, clip_l = str(synthetic_models["clip_g"]), str(synthetic_models["clip_l"])
    assert sd.detect_te_model(file_on_meta(clip_g)) == sd.TEModel.CLIP_G
    built, missing = _missing_clip_keys(caplog, [clip_l, clip_g], "STABLE_DIFFUSION")  # DualCLIPLoader "sdxl"
    assert built == "SDXLClipModel"
    # The SD1.5 CLIP-L file has no text projection; neither SDXL nor SD3 uses CLIP-L's.
    assert missing in ([], ["clip missing: ['text_projection.weight']"])
    built, missing = _missing_clip_keys(caplog, [clip_g], "SD3")
    assert (built, missing) == ("SD3ClipModel_", [])


@pytest.mark.parametrize("part", SPARSE_TEXT_ENCODERS, ids=lambda part: part.key)
def test_the_sparse_text_encoders_are_t5_xxl_and_take_no_disk(synthetic_models, part):
    sd = _comfy("comfy.sd")
    path = synthetic_models[part.key]
    header = file_on_meta(path)
    assert sd.detect_te_model(header) == sd.TEModel.T5_XXL
    assert header["encoder.block.23.layer.1.DenseReluDense.wi_1.weight"].shape[0] == 10240
    assert os.stat(path).st_blocks * 512 < 1 << 20 < os.path.getsize(path)


@pytest.mark.parametrize("key", sorted(VAE_CLASSES))
def test_each_vae_builds_with_no_key_missing_and_decodes_a_latent(synthetic_models, caplog, key):
    sd = _comfy("comfy.sd")
    with caplog.at_level(logging.WARNING):
        vae = sd.VAE(sd=load_file(str(synthetic_models[key])))
    assert type(vae.first_stage_model).__name__ == VAE_CLASSES[key]
    assert not [r for r in caplog.records if "Missing VAE keys" in r.getMessage()]
    video = key == "wan21_vae"
    latent = torch.randn((1, 16, 1, 8, 8) if video else (1, 16, 8, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        image = vae.decode(latent)
    assert tuple(image.shape[-3:]) == (64, 64, 3)
    assert bool(image.isfinite().all()) and float(image.std()) > 0
