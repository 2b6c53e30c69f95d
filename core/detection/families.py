"""The table of diffusion-model families, and the header rules that tell them apart.

Two tables, both read top to bottom with the first match winning (ComfyUI 0.3.75 decides in the same
order, which matters where one family's keys are a subset of another's):

* :data:`BRANCHES`: a marker key routes a file to an architecture branch, whose ``fields`` function reads the
  architecture's hyper-parameters from tensor shapes (never from values);
* :data:`FAMILIES`: each family names the ``comfy.supported_models`` class it corresponds to and the field
  values that class requires, plus its model type and where its VAE and text encoders sit in a checkpoint.

Rules are written from the architectures themselves (which tensor exists, which dimension is the width) and
checked against ComfyUI's own detection in the tests.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .keyview import KeyView

Fields = dict[str, Any]


@dataclass(frozen=True)
class Branch:
    """An architecture branch: its marker keys and how to read its hyper-parameters from shapes."""

    name: str
    markers: tuple[str, ...]
    fields: Callable[[KeyView], Fields | None]
    alternatives: tuple[str, ...] = ()

    def applies(self, view: KeyView) -> bool:
        """Whether the file has every marker (and one of the alternatives, when any are given)."""
        if not view.has_all(self.markers):
            return False
        return not self.alternatives or any(view.has(k) for k in self.alternatives)


@dataclass(frozen=True)
class Family:
    """A family of diffusion models, as ComfyUI knows it.

    Args:
        comfy_class: the ``comfy.supported_models`` class name.
        name: what users call it.
        branch: the architecture branch it belongs to.
        match: hyper-parameters (from the branch's ``fields``) that must all be equal.
        required_keys: keys that must exist anywhere in the file (outside the diffusion-model prefix too).
        model_type: the prediction type, or a rule computing it from the file.
        vae_prefix: where the VAE sits in a full checkpoint (text encoders are found by their own rules).
        dtypes: dtypes ComfyUI computes this family in, preferred first.
    """

    comfy_class: str
    name: str
    branch: str
    match: Mapping[str, Any] = field(default_factory=dict)
    required_keys: tuple[str, ...] = ()
    model_type: str | Callable[[KeyView], str] = "EPS"
    vae_prefix: str = "first_stage_model."
    dtypes: tuple[str, ...] = ("fp16", "bf16", "fp32")

    def mismatches(self, fields: Fields, view: KeyView) -> list[str]:
        """Why this family does not match (empty when it does)."""
        reasons = [
            f"{name} is {fields.get(name, 'absent')!r}, {self.comfy_class} needs {wanted!r}"
            for name, wanted in self.match.items()
            if fields.get(name, _ABSENT) != wanted
        ]
        reasons += [f"key {key!r} is missing" for key in self.required_keys if not view.root_has(key)]
        return reasons

    def type_of(self, view: KeyView) -> str:
        """The model's prediction type (``EPS``, ``V_PREDICTION``, ``FLOW``, ...)."""
        return self.model_type(view) if callable(self.model_type) else self.model_type


_ABSENT = object()


# -- hyper-parameters per branch ---------------------------------------------------------------------------


def _unet(view: KeyView) -> Fields:
    """The SD1/SD2/SDXL/SVD UNet: channel widths, attention depth per level, context width."""
    channels, in_channels = view.shape("input_blocks.0.0.weight")[:2]
    depth: list[int] = []
    context = None
    linear = temporal = False
    for i in range(view.count("input_blocks.{}.")):
        block = f"input_blocks.{i}."
        if view.has(block + "0.op.weight") or not view.has(block + "0.in_layers.0.weight"):
            continue  # a downsampler, or the input convolution
        blocks = view.count(block + "1.transformer_blocks.{}.")
        depth.append(blocks)
        if blocks and context is None:
            context = view.shape(block + "1.transformer_blocks.0.attn2.to_k.weight")[1]
            linear = len(view.shape(block + "1.proj_in.weight")) == 2
            temporal = view.has(block + "1.time_stack.0.attn1.to_q.weight") or view.has(
                block + "1.time_mix_blocks.0.attn1.to_q.weight"
            )
    return {
        "in_channels": in_channels,
        "model_channels": channels,
        "adm_in_channels": view.dim("label_emb.0.0.weight", 1),
        "transformer_depth": depth,
        "context_dim": context,
        "use_linear_in_transformer": linear,
        "use_temporal_attention": temporal,
        "use_temporal_resblock": temporal,
    }


def _mmdit(view: KeyView) -> Fields:
    width, in_channels = view.shape("x_embedder.proj.weight")[:2]
    return {"in_channels": in_channels, "depth": width // 64, "pos_embed_scaling_factor": None}


def _cascade(view: KeyView) -> Fields:
    if view.has("clip_txt_mapper.weight"):
        return {"stable_cascade_stage": "c"}
    return {"stable_cascade_stage": "b"} if view.has("clip_mapper.weight") else {}


def _hunyuan_video(view: KeyView) -> Fields:
    shape = view.shape("img_in.proj.weight")
    return {
        "image_model": "hunyuan_video",
        "in_channels": shape[1],
        "patch_size": list(shape[2:]),
        "vec_in_dim": 768 if view.starts("vector_in.") else None,
        "vision_in_dim": view.dim("vision_in.proj.0.weight", 0),
    }


def _flux(view: KeyView) -> Fields:
    flux2 = view.has("double_stream_modulation_img.lin.weight")
    patch = 1 if flux2 else 2
    fields: Fields = {"image_model": "flux2" if flux2 else "flux", "in_channels": 16}
    if view.has("img_in.weight"):
        fields["in_channels"] = view.shape("img_in.weight")[1] // (patch * patch)
    if view.has("distilled_guidance_layer.0.norms.0.scale") or view.has("distilled_guidance_layer.norms.0.scale"):
        fields["image_model"] = "chroma_radiance" if view.has("nerf_blocks.0.norm.scale") else "chroma"
    else:
        fields["guidance_embed"] = view.has("guidance_in.in_layer.weight")
    return fields


def _wan(view: KeyView) -> Fields:
    kinds = (
        ("vace_patch_embedding.weight", "vace"),
        ("control_adapter.conv.weight", "camera" if view.has("img_emb.proj.0.bias") else "camera_2.2"),
        ("casual_audio_encoder.encoder.final_linear.weight", "s2v"),
        ("audio_proj.audio_proj_glob_1.layer.bias", "humo"),
        ("face_adapter.fuser_blocks.0.k_norm.weight", "animate"),
        ("img_emb.proj.0.bias", "i2v"),
    )
    kind = next((name for key, name in kinds if view.has(key)), "t2v")
    return {
        "image_model": "wan2.1",
        "model_type": kind,
        "dim": view.shape("head.modulation")[-1],
        "out_dim": view.shape("head.head.weight")[0] // 4,
        "in_dim": view.shape("patch_embedding.weight")[1],
    }


def _image_model(name: str) -> Callable[[KeyView], Fields]:
    return lambda _view: {"image_model": name}


BRANCHES: tuple[Branch, ...] = (
    Branch("mmdit", ("joint_blocks.0.context_block.attn.qkv.weight",), _mmdit),
    Branch("stable_cascade", ("clf.1.weight",), _cascade),
    Branch("stable_audio", ("transformer.rotary_pos_emb.inv_freq",), lambda _v: {"audio_model": "dit1.0"}),
    Branch(
        "auraflow", ("double_layers.0.attn.w1q.weight",), lambda v: {"cond_seq_dim": v.dim("cond_seq_linear.weight", 1)}
    ),
    Branch(
        "hunyuan_dit",
        ("mlp_t5.0.weight",),
        lambda v: {"image_model": "hydit1" if v.dim("extra_embedder.0.weight", 1) == 3968 else "hydit"},
    ),
    Branch("hunyuan_video", ("txt_in.individual_token_refiner.blocks.0.norm1.weight",), _hunyuan_video),
    Branch(
        "flux",
        ("double_blocks.0.img_attn.norm.key_norm.scale",),
        _flux,
        alternatives=("img_in.weight", "distilled_guidance_layer.norms.0.scale"),
    ),
    Branch("mochi", ("t5_yproj.weight",), _image_model("mochi_preview")),
    # PixArt saved with diffusers names: ComfyUI's native detection gives up here (see core.detection).
    Branch(
        "pixart_diffusers", ("adaln_single.emb.timestep_embedder.linear_1.bias", "pos_embed.proj.bias"), lambda _v: None
    ),
    Branch("ltxv", ("adaln_single.emb.timestep_embedder.linear_1.bias",), _image_model("ltxv")),
    Branch("ace", ("genre_embedder.weight",), lambda _v: {"audio_model": "ace"}),
    Branch(
        "pixart",
        ("t_block.1.weight",),
        lambda v: {"image_model": "pixart_alpha" if v.has("ar_embedder.mlp.0.weight") else "pixart_sigma"},
    ),
    Branch(
        "cosmos",
        ("blocks.block0.blocks.0.block.attn.to_q.0.weight",),
        lambda v: {"image_model": "cosmos", "in_channels": v.shape("x_embedder.proj.1.weight")[1] // 4 - 1},
    ),
    Branch(
        "lumina2",
        ("cap_embedder.1.weight",),
        lambda v: {"image_model": "lumina2", "dim": v.shape("cap_embedder.1.weight")[0]},
    ),
    Branch("wan", ("head.modulation",), _wan),
    Branch(
        "hunyuan3d2",
        ("latent_in.weight",),
        lambda v: {"image_model": "hunyuan3d2", "depth": v.count("double_blocks.{}.")},
    ),
    Branch("hunyuan3d2_1", ("t_embedder.mlp.2.weight",), _image_model("hunyuan3d2_1")),
    Branch("hidream", ("caption_projection.0.linear.weight",), _image_model("hidream")),
    Branch(
        "cosmos_predict2",
        ("blocks.0.mlp.layer1.weight",),
        lambda v: {"image_model": "cosmos_predict2", "in_channels": v.shape("x_embedder.proj.1.weight")[1] // 4 - 1},
    ),
    Branch("omnigen2", ("time_caption_embed.timestep_embedder.linear_1.bias",), _image_model("omnigen2")),
    Branch(
        "qwen_image",
        ("txt_norm.weight",),
        lambda v: {"image_model": "qwen_image", "in_channels": v.shape("img_in.weight")[1]},
    ),
    Branch("unet", ("input_blocks.0.0.weight",), _unet),
)


# -- diffusion models saved with diffusers names (only read for diffusion-model-only files) ---------------


def _diffusers_unet(view: KeyView) -> Fields:
    """A diffusers UNet, described with the same fields as the native layout."""
    channels, in_channels = view.shape("conv_in.weight")[:2]
    depth: list[int] = []
    context = None
    linear = False
    for i in range(view.count("down_blocks.{}.")):
        attentions = view.count(f"down_blocks.{i}.attentions.{{}}.")
        for a in range(attentions):
            blocks = view.count(f"down_blocks.{i}.attentions.{a}.transformer_blocks.{{}}.")
            depth.append(blocks)
            if blocks and context is None:
                context = view.shape(f"down_blocks.{i}.attentions.{a}.transformer_blocks.0.attn2.to_k.weight")[1]
                linear = len(view.shape(f"down_blocks.{i}.attentions.{a}.proj_in.weight")) == 2
        if not attentions:
            depth += [0] * view.count(f"down_blocks.{i}.resnets.{{}}.")
    adm = view.dim("class_embedding.linear_1.weight", 1) or view.dim("add_embedding.linear_1.weight", 1)
    return {
        "in_channels": in_channels,
        "model_channels": channels,
        "adm_in_channels": adm,
        "transformer_depth": depth,
        "context_dim": context,
        "use_linear_in_transformer": linear,
        "use_temporal_attention": False,
        "use_temporal_resblock": False,
    }


DIFFUSERS_BRANCHES: tuple[Branch, ...] = (
    Branch(
        "auraflow",
        ("joint_transformer_blocks.0.attn.add_k_proj.weight",),
        lambda v: {"cond_seq_dim": v.dim("context_embedder.weight", 1)},
    ),
    Branch(
        "pixart",
        ("adaln_single.emb.timestep_embedder.linear_1.bias", "pos_embed.proj.bias"),
        lambda v: {
            "image_model": "pixart_alpha"
            if v.has("adaln_single.emb.resolution_embedder.linear_1.weight")
            else "pixart_sigma"
        },
    ),
    Branch(
        "flux",
        ("x_embedder.weight",),
        lambda v: {
            "image_model": "flux",
            "in_channels": v.shape("x_embedder.weight")[1] // 4,
            "guidance_embed": v.has("time_text_embed.guidance_embedder.linear_1.weight"),
        },
    ),
    Branch(
        "mmdit",
        ("transformer_blocks.0.attn.add_q_proj.weight", "pos_embed.proj.weight"),
        lambda v: {"in_channels": v.shape("pos_embed.proj.weight")[1], "pos_embed_scaling_factor": None},
    ),
    Branch("unet", ("conv_in.weight",), _diffusers_unet),
)

#: (class, in_channels) of the diffusers UNet layouts ComfyUI 0.3.75 converts; others it cannot load.
DIFFUSERS_UNETS = frozenset(
    {
        ("LotusD", 4),
        ("SDXL", 4),
        ("SDXL", 9),
        ("SDXLRefiner", 4),
        ("SD20", 4),
        ("SD15", 4),
        ("SD15", 9),
        ("SD21UnclipH", 4),
        ("SD21UnclipL", 4),
        ("SSD1B", 4),
        ("Segmind_Vega", 4),
        ("KOALA_700M", 4),
        ("KOALA_1B", 4),
        ("SDXL_instructpix2pix", 8),
    }
)


def find_branch(view: KeyView, branches: tuple[Branch, ...] = BRANCHES) -> Branch | None:
    """The first architecture branch whose markers the file has."""
    return next((branch for branch in branches if branch.applies(view)), None)
