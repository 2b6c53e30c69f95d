"""The families ComfyUI 0.28.0 and 0.33.0 added, as ``tools/make_layouts.py`` builds them: per family the ComfyUI
class, the released model's hyper-parameters and where they come from, how to build it on ``meta``, and the renames
from ComfyUI's state dict to the released file's names; and the classes left out, with the reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

#: What released files store their floating-point weights in, unless a family's ``Spec.dtype`` says otherwise.
STORED_DTYPE = "BF16"
#: The torch dtype each stored dtype is built in (the class's inference dtype).
INFERENCE_DTYPES = {"BF16": "bfloat16", "F16": "float16"}

Convert = Callable[[dict[str, Any]], dict[str, Any]]
BuildContext = Callable[[], AbstractContextManager[Any]]


def _on_meta() -> AbstractContextManager[Any]:
    """Every tensor the constructor makes, with a device or without, on torch's meta device (the usual way)."""
    import torch

    return torch.device("meta")


def _given_device_only() -> AbstractContextManager[Any]:
    """No device context: what ComfyUI passes ``device=meta`` to is made on meta, the rest as on a real load.

    RT-DETR v4's decoder makes its two box-regression scalars (``up``, ``reg_scale``) without a device and reads
    them back with ``Tensor.item()`` to lay out its weighting table, which a meta tensor cannot do. Outside the
    device context those scalars, and the small tables computed from them, are made on CPU; every layer is still
    made on meta (ComfyUI hands the device to each), and a tensor's device changes neither its name, shape nor dtype.
    """
    return contextlib.nullcontext()


@contextlib.contextmanager
def _on_meta_with_quantizer_on_cpu() -> Iterator[None]:
    """Meta, except ACE-Step 1.5's FSQ quantizer layers, which a test-only stand-in builds on CPU.

    FSQ's constructor counts its codebook with ``Tensor.item()`` on a levels tensor made on the device it is
    given, which fails on meta. The stand-in subclass hands it the CPU instead. An FSQ layer whose width is its
    codebook's (as in ResidualFSQ) owns only non-persistent buffers (levels, basis, implicit codebook, 64000 x 6),
    none of which is saved, so the state dict is the one ComfyUI loads; the stand-in refuses to build one that
    would own saved tensors. ComfyUI itself is left untouched: the class is swapped back on exit.
    """
    import torch
    from comfy.ldm.ace import ace_step15

    original = ace_step15.FSQ

    class FSQOnCPU(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, device: Any = None, **kwargs: Any) -> None:
            super().__init__(*args, device=torch.device("cpu"), **kwargs)
            if self.state_dict():
                raise RuntimeError("an FSQ layer owns saved tensors: built on CPU it would change the layout")

    ace_step15.FSQ = FSQOnCPU
    try:
        with torch.device("meta"):
            yield
    finally:
        ace_step15.FSQ = original


@dataclass(frozen=True)
class Spec:
    """One family: the ComfyUI class, what people call it, and the released model's hyper-parameters.

    ``config`` is added to the class's own ``unet_config``; it is what ComfyUI's detection reports for the
    released file (an empty dict: the class's constructor defaults are the released model's, detection only
    names the architecture). ``source`` says where the numbers come from. ``to_file`` turns ComfyUI's internal
    names into the released file's, for the classes whose loader renames keys (the class's own
    ``process_unet_state_dict`` must turn them back, or the family is left out). ``dtype`` is what the released
    file stores (the class is built in it), ``context`` what the constructor runs under. ``checkpoint_rest``
    gives, from the ``unet_config``, the tensors outside the diffusion model that the class's ``get_model`` reads
    from a full checkpoint (they are not part of the layout).
    """

    comfy_class: str
    family: str
    stem: str
    source: str
    config: dict[str, Any] = field(default_factory=dict)
    to_file: Convert | None = None
    dtype: str = STORED_DTYPE
    context: BuildContext = _on_meta
    checkpoint_rest: Callable[[dict[str, Any]], dict[str, Any]] | None = None


def _fused_music_attention(state: dict[str, Any]) -> dict[str, Any]:
    """WanDancer's file keeps its music encoder's attention as one ``in_proj`` (as torch's MultiheadAttention
    saves it); ComfyUI's loader splits it into q/k/v, so the file's layout has them fused again."""
    import torch

    out: dict[str, Any] = {}
    for name, tensor in state.items():
        if "music_encoder" not in name or ".self_attn." not in name or "_proj." not in name or "out_proj" in name:
            out[name] = tensor
        elif ".q_proj." in name:
            stem, suffix = name.split(".q_proj.")
            parts = [state[f"{stem}.{p}_proj.{suffix}"] for p in "qkv"]
            out[f"{stem}.in_proj_{suffix}"] = torch.empty(
                (sum(t.shape[0] for t in parts), *parts[0].shape[1:]), dtype=parts[0].dtype, device="meta"
            )
    return out


def _pixeldit_file_names(state: dict[str, Any]) -> dict[str, Any]:
    """PixelDiT's released file is its trainer's state: the network under ``core.``, each pixel block's adaLN one
    Linear giving shift, scale and gate for attention, then for the MLP. ComfyUI's loader strips ``core.`` and
    splits that Linear into ``adaLN_modulation_msa`` and ``adaLN_modulation_mlp`` (halves along the output, per
    pixel), so the file's layout prefixes every name again and fuses the halves back into ``adaLN_modulation.0``.

    The trainer's REPA projector (``_repa_projector.*``, a training-time head ComfyUI's loader drops) is not
    included: whether the released file still carries it is not known to us, and no rule reads it.
    """
    import torch

    out: dict[str, Any] = {}
    for name, tensor in state.items():
        if ".adaLN_modulation_mlp." in name:
            continue
        if ".adaLN_modulation_msa." in name:
            stem, suffix = name.split(".adaLN_modulation_msa.")
            mlp = state[f"{stem}.adaLN_modulation_mlp.{suffix}"]
            out[f"core.{stem}.adaLN_modulation.0.{suffix}"] = torch.empty(
                (tensor.shape[0] + mlp.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device="meta"
            )
        else:
            out[f"core.{name}"] = tensor
    return out


def _duration_embedder(unet_config: dict[str, Any]) -> dict[str, Any]:
    """Stable Audio 3's ``get_model`` loads its duration (``seconds_total``) embedder from the full checkpoint,
    outside the diffusion model. It feeds the global condition, so it is as wide; a fresh embedder's meta state
    stands in for the checkpoint's (the load fails loudly on any other shape)."""
    import torch
    from comfy.ldm.audio.embedders import NumberConditioner

    with torch.device("meta"):
        embedder = NumberConditioner(
            unet_config["global_cond_dim"], fourier_features_type=unet_config["timestep_features_type"]
        )
    return {f"conditioner.conditioners.seconds_total.{name}": t for name, t in embedder.state_dict().items()}


_DEFAULTS = "the constructor defaults of ComfyUI 0.28.0's model class (its detection only names this architecture)"
_WAN14B = {"dim": 5120, "ffn_dim": 13824, "num_heads": 40, "num_layers": 40, "out_dim": 16}
_WAN14B_SOURCE = (
    "Wan 2.1 14B (dim 5120, ffn 13824, 40 heads, 40 layers), which {} fine-tunes; in_dim from ComfyUI's class"
)
_ZIMAGE = {  # Z-Image's published transformer config (Tongyi-MAI/Z-Image-Turbo transformer/config.json)
    "dim": 3840,
    "n_layers": 30,
    "n_refiner_layers": 2,
    "n_heads": 30,
    "n_kv_heads": 30,
    "cap_feat_dim": 2560,
    "qk_norm": True,
    "axes_dims": [32, 48, 48],
    "axes_lens": [1536, 512, 512],
    "rope_theta": 256.0,
    "ffn_dim_multiplier": 8.0 / 3.0,
    "z_image_modulation": True,
    "time_scale": 1000.0,
    "pad_tokens_multiple": 32,
}
_COSMOS2_2B = {  # Cosmos-Predict2 2B text-to-image (nvidia/Cosmos-Predict2-2B-Text2Image), which Anima is built on
    "max_img_h": 240,
    "max_img_w": 240,
    "max_frames": 128,
    "in_channels": 16,
    "out_channels": 16,
    "patch_spatial": 2,
    "patch_temporal": 1,
    "model_channels": 2048,
    "num_blocks": 28,
    "num_heads": 16,
    "concat_padding_mask": True,
    "crossattn_emb_channels": 1024,
    "pos_emb_cls": "rope3d",
    "pos_emb_learnable": True,
    "pos_emb_interpolation": "crop",
    "min_fps": 1,
    "max_fps": 30,
    "use_adaln_lora": True,
    "adaln_lora_dim": 256,
    "extra_per_block_abs_pos_emb": False,
    "rope_h_extrapolation_ratio": 4.0,
    "rope_w_extrapolation_ratio": 4.0,
    "rope_t_extrapolation_ratio": 1.0,
    "extra_h_extrapolation_ratio": 1.0,
    "extra_w_extrapolation_ratio": 1.0,
    "extra_t_extrapolation_ratio": 1.0,
    "rope_enable_fps_modulation": False,
}
_COGVIDEOX_5B = {"num_attention_heads": 48, "attention_head_dim": 64, "num_layers": 42, "time_embed_dim": 512}
_COGVIDEOX_5B |= {"text_embed_dim": 4096, "patch_size": 2, "use_rotary_positional_embeddings": True}
_FLUX_LIKE = {  # LongCat-Image (meituan-longcat/LongCat-Image transformer/config.json): Flux layout, 10 + 20 blocks
    "in_channels": 16,
    "out_channels": 16,
    "hidden_size": 3072,
    "mlp_ratio": 4.0,
    "num_heads": 24,
    "depth": 10,
    "depth_single_blocks": 20,
    "axes_dim": [16, 56, 56],
    "theta": 10000,
    "patch_size": 2,
    "qkv_bias": True,
    "context_in_dim": 3584,
    "vec_in_dim": None,
    "guidance_embed": False,
    "txt_ids_dims": [1, 2],
}
_SA3 = {  # What ComfyUI's detection reads from a Stable Audio 3 file, common to Small and Medium
    "audio_model": "dit1.0",
    "io_channels": 256,
    "input_concat_dim": 0,
    "global_cond_dim": 768,
    "project_cond_tokens": True,
    "local_add_cond_dim": 257,
    "num_memory_tokens": 64,
    "norm_type": "rms_norm",
    "timestep_features_type": "expo",
    "global_cond_shared_embed": True,
    "global_cond_type": "adaLN",
}
_SA3_SOURCE = (
    "Stable Audio 3 {} as Stability-AI/stable-audio-3 lays it out (the constants of its MLX port, {}): {}; 256-channel"
    " latents, 768-wide text and duration conditions, 257-channel inpainting input, 64 memory tokens, RMS norms;"
    " stored dtype not known to us (BF16 here)"
)
_ACE15 = {  # ACE-Step 1.5 2B (ACE-Step/Ace-Step1.5 acestep-v15-turbo/config.json); also ComfyUI's class defaults
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_heads": 16,
    "num_dit_layers": 24,
    "encoder_hidden_size": 2048,
    "encoder_intermediate_size": 6144,
    "encoder_num_heads": 16,
}

SPECS: tuple[Spec, ...] = (
    Spec("LongCatImage", "LongCat-Image", "longcat_image", "see _FLUX_LIKE", _FLUX_LIKE),
    Spec("LTXAV", "LTX-2 (audio-video)", "ltx2", _DEFAULTS + " (LTX-2 19B: 48 layers, 4096 wide)"),
    Spec(
        "ZImagePixelSpace",
        "Z-Image (pixel space)",
        "zimage_pixel",
        "Z-Image's transformer config; the pixel decoder from ComfyUI's class defaults, 16x16 RGB patches (assumed)",
        {**_ZIMAGE, "patch_size": 16, "in_channels": 3, "decoder_in_channels": 768},
    ),
    Spec("PiD", "PiD (pixel diffusion decoder)", "pid", _DEFAULTS),
    Spec("WAN21_SCAIL", "Wan 2.1 SCAIL", "wan21_scail", _WAN14B_SOURCE.format("SCAIL"), {**_WAN14B, "in_dim": 20}),
    Spec(
        "WAN21_SCAIL2", "Wan 2.1 SCAIL 2", "wan21_scail2", _WAN14B_SOURCE.format("SCAIL 2"), {**_WAN14B, "in_dim": 20}
    ),
    Spec(
        "WAN22_WanDancer",
        "Wan 2.2 WanDancer",
        "wan22_wandancer",
        _WAN14B_SOURCE.format("WanDancer") + "; music attention fused into in_proj as in the released file",
        {**_WAN14B},
        _fused_music_attention,
    ),
    Spec("TripoSplat", "TripoSplat", "triposplat", _DEFAULTS),
    Spec("HiDreamO1", "HiDream-O1", "hidream_o1", _DEFAULTS + " (HiDream-O1-Image 8B)"),
    Spec(
        "SeedVR2",
        "SeedVR2 3B",
        "seedvr2_3b",
        "SeedVR2 3B (ByteDance-Seed/SeedVR2-3B): 2560 wide, 20 heads, 32 layers, SwiGLU",
        {"vid_dim": 2560, "heads": 20, "num_layers": 32, "norm_eps": 1e-5, "mlp_type": "swiglu", "vid_out_norm": True},
    ),
    Spec("Boogu", "Boogu-Image", "boogu", _DEFAULTS),
    Spec("JoyImage", "JoyImage", "joyimage", _DEFAULTS),
    Spec("Ideogram4", "Ideogram 4", "ideogram4", _DEFAULTS),
    Spec("Krea2", "Krea 2", "krea2", _DEFAULTS),
    Spec("Lens", "Lens", "lens", _DEFAULTS + " (Microsoft Lens, 3.8B dual-stream MMDiT)"),
    Spec(
        "Kandinsky5Image",
        "Kandinsky 5.0 Image Lite",
        "kandinsky5_image_lite",
        "Kandinsky 5.0 T2I Lite (kandinskylab): 2560 wide, ff 10240, 50 visual blocks",
        {"ff_dim": 10240, "num_visual_blocks": 50, "axes_dims": [32, 48, 48], "rope_scale_factor": [1.0, 1.0, 1.0]},
    ),
    Spec("Kandinsky5", "Kandinsky 5.0 Video Lite", "kandinsky5_video_lite", _DEFAULTS + " (T2V Lite, 2B)"),
    Spec("Anima", "Anima", "anima", "see _COSMOS2_2B; the LLM adapter from ComfyUI's class defaults", _COSMOS2_2B),
    Spec("ErnieImage", "ERNIE-Image", "ernie_image", _DEFAULTS),
    Spec("SAM3", "SAM 3", "sam3", _DEFAULTS),
    Spec("SAM31", "SAM 3.1", "sam3_1", _DEFAULTS),
    Spec(
        "CogVideoX_Inpaint",
        "CogVideoX Fun 5B inpaint",
        "cogvideox_fun_5b_inp",
        "CogVideoX-5B's transformer config (THUDM/CogVideoX-5b) with the 48 input channels of the Fun inpaint models",
        {**_COGVIDEOX_5B, "in_channels": 48},
    ),
    Spec(
        "CogVideoX_I2V",
        "CogVideoX 5B image-to-video",
        "cogvideox_5b_i2v",
        "THUDM/CogVideoX-5b-I2V transformer/config.json (32 input channels, learned positional embeddings)",
        {**_COGVIDEOX_5B, "in_channels": 32, "use_learned_positional_embeddings": True},
    ),
    Spec("CogVideoX_T2V", "CogVideoX 2B", "cogvideox_2b", _DEFAULTS + " (THUDM/CogVideoX-2b)"),
    Spec("DepthAnything3", "Depth Anything 3", "depth_anything3", _DEFAULTS),
    Spec(
        "StableAudio3",
        "Stable Audio 3 Medium",
        "stable_audio3_medium",
        _SA3_SOURCE.format(
            "Medium (1.4B)", "dit_mlx_medium.py", "1536 wide, 24 layers, 24 heads of 64, differential attention"
        ),
        {
            **_SA3,
            "embed_dim": 1536,
            "depth": 24,
            "num_heads": 24,
            "attn_kwargs": {"qk_norm": "rms", "differential": True},
        },
        checkpoint_rest=_duration_embedder,
    ),
    Spec(
        "StableAudio3",
        "Stable Audio 3 Small",
        "stable_audio3_small",
        _SA3_SOURCE.format("Small (433M, music and sfx)", "dit_mlx.py", "1024 wide, 20 layers, 16 heads of 64"),
        {
            **_SA3,
            "embed_dim": 1024,
            "depth": 20,
            "num_heads": 16,
            "attn_kwargs": {"qk_norm": "rms", "differential": False},
        },
        checkpoint_rest=_duration_embedder,
    ),
    Spec(
        "PixelDiTT2I",
        "PixelDiT 1300M 1024px",
        "pixeldit_1300m_1024px",
        _DEFAULTS
        + " (PixelDiT-1300M-1024px: 1536 wide, 14 patch and 2 pixel blocks, as NVIDIA's trainer builds it); names as"
        " the released file has them: core. prefix, pixel-block adaLN fused (see _pixeldit_file_names), the"
        " training-time REPA projector left out",
        to_file=_pixeldit_file_names,
    ),
    Spec(
        "ACEStep15",
        "ACE-Step 1.5",
        "ace_step15_2b",
        "ACE-Step 1.5 2B (ACE-Step/Ace-Step1.5 acestep-v15-turbo/config.json: 2048 wide, 24 layers, 16 heads, ffn 6144;"
        " condition encoder the same), which are also ComfyUI's class defaults; its FSQ quantizer (no saved tensors)"
        " built on CPU by a test-only stand-in, as FSQ's constructor calls Tensor.item()",
        _ACE15,
        context=_on_meta_with_quantizer_on_cpu,
    ),
    Spec(
        "RT_DETR_v4",
        "RT-DETRv4-X",
        "rt_detr_v4_x",
        "RT-DETRv4-X (RT-DETRs/RT-DETRv4 configs/rtv4/rtv4_hgnetv2_x_coco.yml: HGNetv2-B5, encoder 384 wide, ffn 2048;"
        " decoder 256 wide, ffn 1024, reg_scale 8), ComfyUI's class defaults but the encoder width its detection reads;"
        " F16 as ComfyUI's rt_detr_v4-x-hgnet_fp16 file; built without the meta device context, so the two decoder"
        " scalars its constructor reads with Tensor.item() (and the tables made from them) are made on CPU",
        {"enc_h": 384},
        dtype="F16",
        context=_given_device_only,
    ),
)

#: Classes of ComfyUI 0.28.0 that get no layout, and why (logged when the tool runs).
NOT_BUILT = {
    "WAN21_CausalAR_T2V": "ComfyUI tells it apart only by the file's metadata config, not by tensors",
    "WAN21_FlowRVS": "ComfyUI tells it apart only by the file's metadata config, not by tensors",
}

_DEFAULTS_0_33 = (
    "the constructor defaults of ComfyUI 0.33.0's model class (the released model's are not known to us; its"
    " detection reads {} from shapes)"
)

#: The families ComfyUI 0.33.0 added (``model_layouts_comfyui_0.33.0.json.gz``).
SPECS_0_33: tuple[Spec, ...] = (
    Spec(
        "MiniMaxH3",
        "MiniMax H3 (audio-video)",
        "minimax_h3",
        _DEFAULTS_0_33.format("every width and depth")
        + " (5376 wide, 50 layers and 2 text-refiner layers, 56 heads of 128, ffn 14336, 5120-wide text input);"
        " with the time embedder, not the precomputed adaLN curve table ComfyUI also reads, whose size is not"
        " known to us",
    ),
    Spec(
        "MiniMaxMusic3",
        "MiniMax Music 3",
        "minimax_music3",
        "none to choose: ComfyUI 0.33.0's class fixes every width in its code (2048 wide, 36 layers, 8 condition"
        " layers 4096 wide); stored dtype not known to us (BF16 here)",
    ),
    Spec(
        "MageFlow",
        "Mage-Flow",
        "mage_flow",
        _DEFAULTS_0_33.format("the depth")
        + " (12 double-stream layers, 24 heads of 128, 2560-wide text input, 128 latent channels in 1x1 patches)",
    ),
)

#: Classes of ComfyUI 0.33.0 that get no layout, and why (logged when the tool runs).
NOT_BUILT_0_33 = {
    "WAN_Animate2": "its tensors are Wan 2.1 image-to-video 14B's; ComfyUI tells it apart only by the file's"
    " metadata config",
}

#: By ComfyUI version: the families it added (one layouts file each), and its classes that get no layout.
ADDED: dict[str, tuple[tuple[Spec, ...], dict[str, str]]] = {
    "0.28.0": (SPECS, NOT_BUILT),
    "0.33.0": (SPECS_0_33, NOT_BUILT_0_33),
}
