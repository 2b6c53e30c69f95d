"""The architecture branches of diffusion models: the header rules that route a file to one, and read its
hyper-parameters.

:data:`BRANCHES` is read top to bottom with the first match winning (ComfyUI decides in the same order, which
matters where one architecture's keys are a subset of another's; what ComfyUI 0.28 and 0.33 added sits where they
have it): a marker key routes a file to an architecture branch, whose ``fields`` function reads the
architecture's hyper-parameters from tensor shapes (never from values). Which family a branch's fields make is
the families table's part (:mod:`.family_table`: each family names the ``comfy.supported_models`` class it
corresponds to and the field values that class requires, plus its model type and where its VAE sits).

Files saved with diffusers names have branches of their own, in :mod:`.diffusers_branches`. Rules are written
from the architectures themselves (which tensor exists, which dimension is the width) and checked against
ComfyUI's own detection in the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .keyview import KeyView

Fields = dict[str, Any]
_SAM3_TRUNK = "detector.backbone.vision_backbone.trunk.blocks.0.attn.qkv.weight"
_DA3_PATCHES = "backbone.embeddings.patch_embeddings.projection.weight"
_DA3_WIDTHS = (384, 768, 1024, 1536)  # the DINOv2 backbones ComfyUI has presets for: ViT-S/B/L/G
_FLUX_INPUTS = ("img_in.weight", "distilled_guidance_layer.norms.0.scale", "distilled_guidance_layer.norms.0.weight")
#: MiniMax Music 3: its condition-layer mix, its condition convolution and its DiT's first attention (all three).
_MINIMAX_MUSIC3 = (
    "cond_layer_logits",
    "latent_conditioners.0.weight",
    "diffusion_transformer.transformer.layers.0.self_attn.to_qkv.weight",
)
#: Mage-Flow is Qwen-Image's double-stream layout with a 2560-wide text input and 128 latent channels, unpacked
#: (Qwen-Image's text input is 3584 wide, its output 64 channels: 16 latent channels in 2x2 patches).
_MAGE_FLOW_TEXT, _MAGE_FLOW_OUT = 2560, 128


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


def _norm(view: KeyView, *stems: str) -> bool:
    """Whether a norm is there: ComfyUI up to 0.3 names its scale ``scale``, 0.28 names it ``weight``."""
    return any(view.has(stem + suffix) for stem in stems for suffix in ("scale", "weight"))


def _flux(view: KeyView) -> Fields:
    flux2 = view.has("double_stream_modulation_img.lin.weight")
    patch = 1 if flux2 else 2
    fields: Fields = {"image_model": "flux2" if flux2 else "flux", "in_channels": 16}
    if view.has("img_in.weight"):
        fields["in_channels"] = view.shape("img_in.weight")[1] // (patch * patch)
    if _norm(view, "distilled_guidance_layer.0.norms.0.", "distilled_guidance_layer.norms.0."):
        fields["image_model"] = "chroma_radiance" if _norm(view, "nerf_blocks.0.norm.") else "chroma"
    else:
        fields["guidance_embed"] = view.has("guidance_in.in_layer.weight")
    # LongCat-Image is Flux's layout with a wider text input and no pooled vector.
    fields["context_in_dim"] = view.dim("txt_in.weight", 1, 4096)
    fields["vec_in_dim"] = view.dim("vector_in.in_layer.weight", 1)
    return fields


def _wan(view: KeyView) -> Fields:
    kinds = (
        ("vace_patch_embedding.weight", "vace"),
        ("control_adapter.conv.weight", "camera" if view.has("img_emb.proj.0.bias") else "camera_2.2"),
        ("casual_audio_encoder.encoder.final_linear.weight", "s2v"),
        ("audio_proj.audio_proj_glob_1.layer.bias", "humo"),
        ("face_adapter.fuser_blocks.0.k_norm.weight", "animate"),
        ("patch_embedding_mask.weight", "scail2"),  # SCAIL 2 adds a mask input to SCAIL's pose input
        ("patch_embedding_pose.weight", "scail"),
        ("patch_embedding_global.weight", "wandancer"),
        ("img_emb.proj.0.bias", "i2v"),
    )
    kind = next((name for key, name in kinds if view.has(key)), "t2v")
    fields = {
        "image_model": "wan2.1",
        "model_type": kind,
        "dim": view.shape("head.modulation")[-1],
        "out_dim": view.shape("head.head.weight")[0] // 4,
        "in_dim": view.shape("patch_embedding.weight")[1],
    }
    # Causal (autoregressive) and FlowRVS Wan files share every key with text-to-video: only their metadata says.
    return fields | view.declared("transformer")


def _lumina2(view: KeyView) -> Fields:
    """Lumina 2 and Z-Image (3840 wide); Z-Image's pixel-space variant decodes patches with its own network."""
    dim = view.shape("cap_embedder.1.weight")[0]
    pixel = dim == 3840 and view.has("dec_net.cond_embed.weight")
    return {"image_model": "zimage_pixel" if pixel else "lumina2", "dim": dim}


def _cogvideox(view: KeyView) -> Fields:
    """CogVideoX 1.0 embeds patches with a convolution, 1.5 with a linear layer over 2x2x2 patches."""
    shape = view.shape("patch_embed.proj.weight")
    return {"image_model": "cogvideox", "in_channels": shape[1] // 8 if len(shape) == 2 else shape[1]}


def _seedvr2(view: KeyView) -> Fields | None:
    """SeedVR2 7B and 3B, told by their last block; the models carry their own prompt embeddings."""
    if view.has("blocks.35.mlp.vid.proj_out.weight") and view.shape("blocks.35.mlp.vid.proj_out.weight")[0] != 3072:
        return None
    conditioned = view.has("positive_conditioning") and view.has("negative_conditioning")
    return {"image_model": "seedvr2", "conditioning": conditioned}


def _gated(name: str, key: str, allowed: Callable[[tuple[int, ...]], bool]) -> Callable[[KeyView], Fields | None]:
    """``image_model`` ``name`` only when ``key`` has a shape ComfyUI takes (for any other, it finds no model)."""
    return lambda view: {"image_model": name} if allowed(view.shape(key)) else None


def _stable_audio(view: KeyView) -> Fields:
    """Stable Audio 3 embeds the global condition once, for all layers."""
    return {"audio_model": "dit1.0", "global_cond_shared_embed": view.has("transformer.global_cond_embedder.0.weight")}


def _qwen_image(view: KeyView) -> Fields:
    """Qwen-Image, or Mage-Flow when both its text input and its output have Mage-Flow's width (either alone is
    still Qwen-Image, as for ComfyUI)."""
    mage = view.dim("txt_norm.weight", 0) == _MAGE_FLOW_TEXT and view.dim("proj_out.weight", 0) == _MAGE_FLOW_OUT
    return {"image_model": "mage_flow" if mage else "qwen_image", "in_channels": view.shape("img_in.weight")[1]}


def _kandinsky5(view: KeyView) -> Fields:
    """Kandinsky 5's image models differ from its video models in width and visual embedding."""
    width, visual = view.shape("visual_embeddings.in_layer.weight")[:2]
    return {"image_model": "kandinsky5", "model_dim": width, "visual_embed_dim": visual}


def _either(key: str, present: str, absent: str) -> Callable[[KeyView], Fields]:
    """A variant told by one key: ``image_model`` is ``present`` when the file has ``key``, else ``absent``."""
    return lambda view: {"image_model": present if view.has(key) else absent}


def _image_model(name: str) -> Callable[[KeyView], Fields]:
    return lambda _view: {"image_model": name}  # the branch's markers alone name the architecture


def _named(name: str, *markers: str) -> Branch:
    """A branch named as ComfyUI's ``image_model`` for it, whose markers alone name the architecture."""
    return Branch(name, markers, _image_model(name))


BRANCHES: tuple[Branch, ...] = (
    Branch("minimax_music3", _MINIMAX_MUSIC3, lambda _v: {"audio_model": "minimax_music3"}),  # first, as in ComfyUI
    Branch("mmdit", ("joint_blocks.0.context_block.attn.qkv.weight",), _mmdit),
    Branch("stable_cascade", ("clf.1.weight",), _cascade),
    Branch("stable_audio", ("transformer.rotary_pos_emb.inv_freq",), _stable_audio),
    Branch(
        "auraflow", ("double_layers.0.attn.w1q.weight",), lambda v: {"cond_seq_dim": v.dim("cond_seq_linear.weight", 1)}
    ),
    Branch(
        "hunyuan_dit",
        ("mlp_t5.0.weight",),
        lambda v: {"image_model": "hydit1" if v.dim("extra_embedder.0.weight", 1) == 3968 else "hydit"},
    ),
    Branch("hunyuan_video", ("txt_in.individual_token_refiner.blocks.0.norm1.weight",), _hunyuan_video),
    Branch("flux", ("double_blocks.0.img_attn.norm.key_norm.scale",), _flux, alternatives=_FLUX_INPUTS),
    Branch("flux", ("double_blocks.0.img_attn.norm.key_norm.weight",), _flux, alternatives=_FLUX_INPUTS),
    Branch("mochi", ("t5_yproj.weight",), _image_model("mochi_preview")),
    # PixArt saved with diffusers names: ComfyUI's native detection gives up here (see core.detection).
    Branch(
        "pixart_diffusers", ("adaln_single.emb.timestep_embedder.linear_1.bias", "pos_embed.proj.bias"), lambda _v: None
    ),
    _named("minimax_h3", "video_patch_proj.weight", "audio_patch_proj.weight"),  # one stream of video and audio
    Branch(
        "ltxv",
        ("adaln_single.emb.timestep_embedder.linear_1.bias",),
        _either("audio_adaln_single.linear.weight", "ltxav", "ltxv"),
    ),
    Branch("ace", ("genre_embedder.weight",), lambda _v: {"audio_model": "ace"}),
    Branch(
        "pixart",
        ("t_block.1.weight",),
        _either("ar_embedder.mlp.0.weight", "pixart_alpha", "pixart_sigma"),
    ),
    Branch(
        "cosmos",
        ("blocks.block0.blocks.0.block.attn.to_q.0.weight",),
        lambda v: {"image_model": "cosmos", "in_channels": v.shape("x_embedder.proj.1.weight")[1] // 4 - 1},
    ),
    _named("pid", "lq_proj.latent_proj.0.weight"),  # PiD before PixelDiT, whose keys it shares
    Branch("pixeldit_t2i", ("core.pixel_embedder.proj.weight",), _image_model("pixeldit_t2i")),
    Branch("lumina2", ("cap_embedder.1.weight",), _lumina2),
    Branch("cogvideox", ("blocks.0.norm1.linear.weight",), _cogvideox),
    Branch("seedvr2", ("blocks.35.mlp.vid.proj_out.weight",), _seedvr2),  # 7B, a separate MLP per stream
    Branch("seedvr2", ("blocks.35.mlp.all.proj_in_gate.weight",), _seedvr2),  # 7B, a shared MLP
    Branch("seedvr2", ("blocks.31.mlp.all.proj_in_gate.weight",), _seedvr2),  # 3B
    Branch("wan", ("head.modulation",), _wan),
    Branch(
        "hunyuan3d2",
        ("latent_in.weight",),
        lambda v: {"image_model": "hunyuan3d2", "depth": v.count("double_blocks.{}.")},
    ),
    Branch("hunyuan3d2_1", ("t_embedder.mlp.2.weight", "blocks.0.attn1.k_norm.weight"), _image_model("hunyuan3d2_1")),
    _named("triposplat", "cam_out_layer.weight", "repo_layers.0.final_map.weight"),
    _named("hidream_o1", "t_embedder1.mlp.0.weight", "x_embedder.proj1.weight"),
    Branch("hidream", ("caption_projection.0.linear.weight",), _image_model("hidream")),
    Branch(
        "cosmos_predict2",
        ("blocks.0.mlp.layer1.weight",),
        lambda v: {
            "image_model": "anima" if v.has("llm_adapter.blocks.0.cross_attn.q_proj.weight") else "cosmos_predict2",
            "in_channels": v.shape("x_embedder.proj.1.weight")[1] // 4 - 1,
        },
    ),
    _named("boogu", "double_stream_layers.0.img_instruct_attn.processor.img_to_q.weight"),  # OmniGen2's keys and more
    Branch("omnigen2", ("time_caption_embed.timestep_embedder.linear_1.bias",), _image_model("omnigen2")),
    _named("lens", "transformer_blocks.0.attn.norm_added_q.weight", "transformer_blocks.0.img_mlp.w1.weight"),
    Branch("qwen_image", ("txt_norm.weight",), _qwen_image),
    _named("ideogram4", "embed_image_indicator.weight"),
    _named("krea2", "txtfusion.projector.weight"),
    Branch("kandinsky5", ("visual_transformer_blocks.0.cross_attention.key_norm.weight",), _kandinsky5),
    Branch("ace15", ("encoder.lyric_encoder.layers.0.input_layernorm.weight",), lambda _v: {"audio_model": "ace1.5"}),
    Branch("rt_detr_v4", ("encoder.pan_blocks.1.cv4.conv.weight",), _image_model("RT_DETR_v4")),
    Branch("depth_anything3", (_DA3_PATCHES,), _gated("DepthAnything3", _DA3_PATCHES, lambda s: s[0] in _DA3_WIDTHS)),
    _named("ernie", "layers.0.mlp.linear_fc2.weight"),
    Branch(  # SAM 3.1 adds propagation convolutions to SAM 3's vision backbone
        "sam3",
        (_SAM3_TRUNK, "detector.transformer.decoder.query_embed.weight"),
        _either("detector.backbone.vision_backbone.propagation_convs.0.conv_1x1.weight", "SAM31", "SAM3"),
    ),
    Branch(
        "joyimage",
        ("double_blocks.0.attn.img_attn_qkv.weight", "double_blocks.0.attn.img_attn_q_norm.weight", "img_in.weight"),
        _gated("joyimage", "img_in.weight", lambda shape: len(shape) == 5),  # a 3-D patch convolution
        alternatives=("condition_embedder.time_embedder.linear_1.weight",),
    ),
    Branch("unet", ("input_blocks.0.0.weight",), _unet),
)


def find_branch(view: KeyView, branches: tuple[Branch, ...] = BRANCHES) -> Branch | None:
    """The first architecture branch whose markers the file has."""
    return next((branch for branch in branches if branch.applies(view)), None)
