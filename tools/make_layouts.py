"""Make ``tests/data/model_layouts_comfyui_0.28.0.json.gz``: the layouts of the families ComfyUI 0.28.0 added.

No model hub is reachable from CI and real weights must never be committed, so, as for
``model_layouts.json.gz``, each family's layout (tensor names, shapes, dtypes; no values) comes from ComfyUI
0.28.0's own model class built on torch's ``meta`` device with the hyper-parameters of the released model. Its
diffusion-model ``state_dict`` is what ComfyUI reads from a ``diffusion_models/`` file; each layout is fed back
through ComfyUI's own detection, which must name the class it was built from, or the family is left out.

Run with the runtime's Python and ComfyUI 0.28.0::

    DEVICE_CONTROL_COMFYUI=0.28.0 .runtime/venv/bin/python -m tools.make_layouts
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.runtime import REPO

log = logging.getLogger("device_control.tools")

COMFYUI_VERSION = "0.28.0"
TARGET = REPO / "tests" / "data" / f"model_layouts_comfyui_{COMFYUI_VERSION}.json.gz"
#: What released files store their floating-point weights in (every family here ships BF16 weights).
STORED_DTYPE = "BF16"

Convert = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Spec:
    """One family: the ComfyUI class, what people call it, and the released model's hyper-parameters.

    ``config`` is added to the class's own ``unet_config``; it is what ComfyUI's detection reports for the
    released file (an empty dict: the class's constructor defaults are the released model's, detection only
    names the architecture). ``source`` says where the numbers come from. ``to_file`` turns ComfyUI's internal
    names into the released file's, for the classes whose loader renames keys.
    """

    comfy_class: str
    family: str
    stem: str
    source: str
    config: dict[str, Any] = field(default_factory=dict)
    to_file: Convert | None = None


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
)

#: Classes of ComfyUI 0.28.0 that get no layout, and why (logged when the tool runs).
NOT_BUILT = {
    "StableAudio3": "its released hyper-parameters are not known to us (detection reads a dozen of them)",
    "PixelDiTT2I": "its loader renames and splits keys of the released file; the inverse is not written yet",
    "WAN21_CausalAR_T2V": "ComfyUI tells it apart only by the file's metadata config, not by tensors",
    "WAN21_FlowRVS": "ComfyUI tells it apart only by the file's metadata config, not by tensors",
    "ACEStep15": "cannot be built on meta (its constructor calls Tensor.item())",
    "RT_DETR_v4": "cannot be built on meta (its constructor calls Tensor.item())",
}


def _dtype_name(dtype: Any) -> str:
    """The safetensors name of a torch dtype (``BF16``, ``F32``, ...)."""
    from core.detection.headers import SAFETENSORS_DTYPES

    return next(name for name, (_size, torch_dtype) in SAFETENSORS_DTYPES.items() if torch_dtype == dtype)


def build(spec: Spec) -> tuple[dict[str, Any], str]:
    """ComfyUI's model for ``spec`` on meta: its diffusion-model state dict (file names), and its model type."""
    import comfy.supported_models
    import torch

    cls = getattr(comfy.supported_models, spec.comfy_class)
    with torch.device("meta"):
        config = cls({**cls.unet_config, **spec.config})
        config.set_inference_dtype(torch.bfloat16, None)
        model = config.get_model({}, "", device=torch.device("meta"))
    state = dict(model.diffusion_model.state_dict())
    if spec.to_file is not None:
        state = spec.to_file(state)
    return state, model.model_type.name


def detected_class(state: dict[str, Any]) -> str | None:
    """What ComfyUI's ``load_diffusion_model`` path detects ``state`` as (meta tensors, no prefix)."""
    import comfy.model_detection

    prefix = comfy.model_detection.unet_prefix_from_state_dict(state)
    stripped = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)} or state
    config = comfy.model_detection.model_config_from_unet(stripped, "")
    return type(config).__name__ if config is not None else None


def layout(spec: Spec, state: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The layout record, in the format of ``model_layouts.json.gz`` (see ``tests/data/README.md``)."""
    tensors = {name: [list(t.shape), _dtype_name(t.dtype)] for name, t in sorted(state.items())}
    exceptions = {name: dtype for name, (_shape, dtype) in tensors.items() if dtype != STORED_DTYPE}
    return {
        "family": spec.family,
        "comfy_detected": spec.comfy_class,
        "kind": "diffusion_model",
        "dtype_default": STORED_DTYPE,
        "param_count": sum(math.prod(shape) for shape, _dtype in tensors.values()),
        "tensor_count": len(tensors),
        "comfy_detection": {
            "unet_prefix": "model.",
            "path": "load_diffusion_model_state_dict",
            "class": spec.comfy_class,
            "model_type": model_type,
        },
        "comfy_native_dtype_exceptions": exceptions,
        "source": (
            f"ComfyUI {COMFYUI_VERSION} model class instantiated on meta with inference dtype bfloat16; state_dict()"
            f" of diffusion_model (no prefix); hyper-parameters: {spec.source}"
        ),
        "tensors": tensors,
    }


def make_all(only: set[str] | None = None) -> dict[str, dict[str, Any]]:
    """Every layout ComfyUI's own detection confirms, by file name; the others are logged and left out."""
    for name, why in NOT_BUILT.items():
        log.warning("[Device Control] %s: no layout, %s", name, why)
    made: dict[str, dict[str, Any]] = {}
    for spec in SPECS:
        if only and spec.comfy_class not in only:
            continue
        try:
            state, model_type = build(spec)
        except Exception as error:  # a class that cannot be built on meta is skipped, and said so
            log.warning("[Device Control] %s: no layout, cannot be built on meta (%s)", spec.comfy_class, error)
            continue
        found = detected_class(state)
        if found != spec.comfy_class:
            log.warning("[Device Control] %s: no layout, ComfyUI detects the layout as %s", spec.comfy_class, found)
            continue
        made[f"{spec.stem}.diffusion_model.json"] = layout(spec, state, model_type)
        log.info("[Device Control] %s: %d tensors", spec.comfy_class, len(state))
    return made


def write(layouts: dict[str, dict[str, Any]], target: Path = TARGET) -> Path:
    """Write ``layouts`` gzipped (no name, mtime 0: the same layouts give the same bytes)."""
    raw = json.dumps(layouts, separators=(",", ":"), sort_keys=True).encode()
    with open(target, "wb") as handle, gzip.GzipFile(filename="", fileobj=handle, mode="wb", mtime=0) as packed:
        packed.write(raw)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=f"Write the layouts of the model families ComfyUI {COMFYUI_VERSION} added, built on meta."
    )
    parser.add_argument("--only", nargs="*", help="comfy.supported_models class names (default: every family)")
    parser.add_argument("--output", type=Path, default=TARGET, help="where to write the gzipped JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # ComfyUI's own INFO lines are noise here
    log.setLevel(logging.INFO)
    from tools.comfy_inprocess import import_comfy
    from tools.runtime import DEFAULT_VERSION

    if DEFAULT_VERSION != COMFYUI_VERSION:
        log.error("[Device Control] run with DEVICE_CONTROL_COMFYUI=%s (got %s)", COMFYUI_VERSION, DEFAULT_VERSION)
        return 2
    import_comfy()
    made = make_all(set(args.only) if args.only else None)
    log.info("[Device Control] wrote %d layouts to %s", len(made), write(made, args.output))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
