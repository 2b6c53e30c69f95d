"""What a ControlNet, CLIP vision, model patch or upscale file is, from its header (``core.detection.model_types``).

The names each format is told by are ComfyUI's own checks (``tests/integration/test_model_type_oracle.py`` asks
the running ComfyUI the same question on the same names); here, each format is named, a file of one kind given
to another kind's loader is named as what it is, and a file of no kind is ``unknown``.
"""

from __future__ import annotations

import pytest

from core.detection.headers import FileHeader, TensorInfo
from core.detection.model_types import MODEL_TYPE_NOUNS, detect_model_type
from tools.fixtures.layouts import layouts


def header(*names: str, shapes: dict[str, tuple[int, ...]] | None = None) -> FileHeader:
    shapes = shapes or {}
    tensors = {name: TensorInfo(name, "F16", shapes.get(name, (4, 4))) for name in names}
    return FileHeader("file.safetensors", "safetensors", tensors)


ATTN = "input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight"
#: (names, the format's name, difference, placeable): one case per format ComfyUI tells apart.
CONTROLNETS = [
    (("control_model.zero_convs.0.0.weight", "control_model." + ATTN), "ControlNet, SD1.x", False, True),
    (("zero_convs.0.0.weight", ATTN), "ControlNet, SD1.x", False, True),
    (("zero_convs.0.0.weight", "label_emb.0.0.weight"), "ControlNet, SDXL", False, True),
    (("zero_convs.0.0.weight", "difference", ATTN), "ControlNet, SD1.x", True, True),
    (("controlnet_cond_embedding.conv_in.weight",), "diffusers ControlNet, SD1.x/SD2.x", False, True),
    (
        (
            "controlnet_cond_embedding.conv_in.weight",
            "add_embedding.linear_1.weight",
            "control_add_embedding.linear_1.bias",
        ),
        "diffusers ControlNet (union), SDXL",
        False,
        True,
    ),
    (("after_proj_list.18.bias",), "HunyuanDiT ControlNet", False, True),
    (("lora_controlnet",), "Control-LoRA", False, True),
    (
        ("controlnet_blocks.0.weight", "double_blocks.0.img_attn.norm.key_norm.scale"),
        "Flux ControlNet (XLabs)",
        False,
        True,
    ),
    (
        ("controlnet_blocks.0.weight", "pos_embed_input.proj.weight", "transformer_blocks.0.adaLN_modulation.1.bias"),
        "SD3.5 ControlNet (Stability)",
        False,
        True,
    ),
    (("controlnet_blocks.0.weight", "pos_embed_input.proj.weight"), "SD3 ControlNet (diffusers)", False, True),
    (("controlnet_blocks.0.weight", "controlnet_x_embedder.weight"), "Flux ControlNet (InstantX, union)", False, True),
    (("controlnet_blocks.0.linear.weight",), "Flux ControlNet (MistoLine)", False, True),
    (("body.0.in_conv.weight",), "T2I-Adapter (light)", False, False),
    (("conv_in.weight", "body.0.block2.weight"), "T2I-Adapter", False, False),
]


@pytest.mark.parametrize(("names", "name", "difference", "placeable"), CONTROLNETS, ids=[c[1] for c in CONTROLNETS])
def test_each_controlnet_format_is_named_as_comfyui_tells_it(names, name, difference, placeable):
    shapes = {n: (320, 768) for n in names if n.endswith("attn2.to_k.weight")}
    found = detect_model_type(header(*names, shapes=shapes), "controlnet")
    assert (found.kind, found.format, found.difference, found.placeable) == ("controlnet", name, difference, placeable)


def test_a_controlnets_family_follows_its_context_width():
    for width, family in ((768, "SD1.x"), (1024, "SD2.x"), (2048, "SDXL")):
        found = detect_model_type(header("zero_convs.0.0.weight", ATTN, shapes={ATTN: (320, width)}), "controlnet")
        assert found.format == f"ControlNet, {family}"


CLIP_VISIONS = [
    (("vision_model.encoder.layers.47.layer_norm1.weight",), {}, "CLIP vision ViT-bigG"),
    (("vision_model.encoder.layers.30.layer_norm1.weight",), {}, "CLIP vision ViT-H"),
    (
        (
            "vision_model.encoder.layers.22.layer_norm1.weight",
            "vision_model.encoder.layers.0.layer_norm1.weight",
            "vision_model.embeddings.position_embedding.weight",
        ),
        {
            "vision_model.encoder.layers.0.layer_norm1.weight": (1024,),
            "vision_model.embeddings.position_embedding.weight": (257, 1024),
        },
        "CLIP vision ViT-L",
    ),
    (
        (
            "vision_model.encoder.layers.22.layer_norm1.weight",
            "vision_model.encoder.layers.0.layer_norm1.weight",
            "vision_model.embeddings.position_embedding.weight",
            "vision_model.embeddings.patch_embedding.weight",
        ),
        {
            "vision_model.encoder.layers.0.layer_norm1.weight": (1152,),
            "vision_model.embeddings.position_embedding.weight": (729, 1152),
            "vision_model.embeddings.patch_embedding.weight": (1152, 3, 14, 14),
        },
        "SigLIP 384",
    ),
    (("encoder.layer.23.layer_scale2.lambda1",), {}, "DINOv2 large"),
    (
        tuple(f"visual.transformer.resblocks.{i}.attn.in_proj_weight" for i in range(32)),
        {},
        "CLIP vision ViT-H (OpenCLIP names)",
    ),
]


@pytest.mark.parametrize(("names", "shapes", "name"), CLIP_VISIONS, ids=[c[2] for c in CLIP_VISIONS])
def test_each_clip_vision_format_is_named_as_comfyui_tells_it(names, shapes, name):
    found = detect_model_type(header(*names, shapes=shapes), "clip_vision")
    assert (found.kind, found.format) == ("clip_vision", name)


def test_model_patches_and_upscale_models_are_named():
    patch = detect_model_type(header("feature_embedder.mid_layer_norm.bias"), "model_patch")
    assert (patch.kind, patch.format) == ("model_patch", "USO style projector (SigLIP features)")
    qwen = detect_model_type(header("controlnet_blocks.0.y_rms.weight", "img_in.weight"), "model_patch")
    assert qwen.format == "Qwen-Image block-wise ControlNet (DiffSynth)"
    esrgan = detect_model_type(header("conv_first.weight", "body.0.rdb1.conv1.weight"), "upscale_model")
    assert (esrgan.kind, esrgan.format) == ("upscale_model", "ESRGAN (RRDBNet)")


@pytest.mark.parametrize("wanted", sorted(MODEL_TYPE_NOUNS))
def test_a_file_of_another_kind_is_named_as_what_it_is(wanted):
    """A checkpoint, a VAE, a LoRA or another of these kinds, given to a loader of ``wanted``: named by kind, so
    the loader's refusal says which node takes it."""
    others = {
        "controlnet": header("zero_convs.0.0.weight", ATTN, shapes={ATTN: (320, 768)}),
        "clip_vision": header("vision_model.encoder.layers.30.layer_norm1.weight"),
        "model_patch": header("feature_embedder.mid_layer_norm.bias"),
    }
    for kind, file in others.items():
        if kind != wanted:
            assert detect_model_type(file, wanted).kind == kind
    sd15 = layouts()["sd15.checkpoint.json"]["tensors"]
    checkpoint = {name: TensorInfo(name, dtype, tuple(shape)) for name, (shape, dtype) in sd15.items()}
    found = detect_model_type(FileHeader("sd15.safetensors", "safetensors", checkpoint), wanted)
    assert (found.kind, found.noun) == ("checkpoint", "checkpoint")
    vae = layouts()["vae_sd_kl_f8.json"]["tensors"]
    infos = {name: TensorInfo(name, dtype, tuple(shape)) for name, (shape, dtype) in vae.items()}
    assert detect_model_type(FileHeader("vae.safetensors", "safetensors", infos), wanted).kind == "vae"


def test_a_file_of_no_kind_is_unknown_with_its_size():
    found = detect_model_type(header("some.tensor", "another.tensor"), "controlnet")
    assert found.kind == "unknown" and found.bytes == 2 * 16 * 2
