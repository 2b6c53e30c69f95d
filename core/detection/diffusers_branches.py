"""Diffusion models saved with diffusers names: the branches that read them, and the UNets ComfyUI converts.

Only read for diffusion-model-only files, after the native branches of :mod:`.families` found nothing; a match
is reported as a native family, with a ``diffusers names`` variant.
"""

from __future__ import annotations

from .branches import Branch, Fields, _either
from .keyview import KeyView


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
        _either("adaln_single.emb.resolution_embedder.linear_1.weight", "pixart_alpha", "pixart_sigma"),
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
    [(name, 4) for name in ("LotusD", "SDXL", "SDXLRefiner", "SD20", "SD15", "SD21UnclipH", "SD21UnclipL", "SSD1B")]
    + [(name, 4) for name in ("Segmind_Vega", "KOALA_700M", "KOALA_1B")]
    + [("SDXL", 9), ("SD15", 9), ("SDXL_instructpix2pix", 8)]
)
