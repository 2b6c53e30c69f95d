"""Make the synthetic test models: an architecturally real SD1.5 checkpoint, a LoRA for it, the same SD1.5
as the split files ComfyUI's own split loaders read, and a small SD3.5-layout diffusion model.

No model hub is reachable from CI, and real weights must never be committed. So we build ComfyUI's own
SD1.5 classes on torch's ``meta`` device (no memory), take the key layout ComfyUI itself writes when it
saves a checkpoint (``state_dict_for_saving``), fill it with small seeded random weights (N(0, 0.02) for
matrices and kernels, 1 for norm scales, 0 for biases: pure zeros would give degenerate images), check
with ComfyUI's detection that it is SD1.5, and write fp16 safetensors. The LoRA is rank 4, in kohya
naming, built from ComfyUI's own LoRA key maps for that model and checked to load every key.

The split files are the checkpoint's own tensors under the names ComfyUI's ``UNETLoader``, ``CLIPLoader``
and ``VAELoader`` read (what model hubs ship as separate files). The SD3.5-layout model is ComfyUI's own SD3
class (the one that builds SD3.5 Large) with the hidden size shrunk to 512 (8 joint blocks), so a DiT family
loads through the stock ``UNETLoader`` and samples in seconds; its text conditioning is SD1.5's CLIP-L (768
features, pooled and per token), which its input layers are sized for.

:func:`make_all` also makes the fixtures of other model families (SDXL, SD3.5, Flux, Chroma, Wan 2.1, their
LoRAs, text encoders and VAEs): see :mod:`tools.make_family_fixtures`.

Files are cached in the runtime's ``fixtures/`` folder: these are rebuilt only when :data:`FIXTURE_VERSION`
changes, each family fixture only when its own version stamp does. Run with the runtime's Python:
``.runtime/venv/bin/python -m tools.make_fixtures``.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tools.comfy_inprocess import import_comfy
from tools.gguf_files import FLUX_GGUF, write_gguf
from tools.make_family_fixtures import make_family_fixtures
from tools.runtime import fixtures_dir

log = logging.getLogger("device_control.tools")

FIXTURE_VERSION = "1"
SD15_CHECKPOINT = "device_control_sd15_synthetic.safetensors"
SD15_LORA = "device_control_sd15_lora_r4.safetensors"
#: A second checkpoint name for two-model workflows: a hard link to the first (two models in memory, one file).
SD15_CHECKPOINT_B = "device_control_sd15_synthetic_b.safetensors"
#: The checkpoint's parts, as separate files in ComfyUI's ``diffusion_models``, ``text_encoders`` and ``vae``.
SD15_UNET = "device_control_sd15_unet.safetensors"
SD15_CLIP_L = "device_control_sd15_clip_l.safetensors"
SD15_VAE = "device_control_sd15_vae.safetensors"
#: A small diffusion model in SD3.5 Large's layout (ComfyUI class ``SD3``), for the stock ``UNETLoader``.
SD35_TINY = "device_control_sd35_tiny.safetensors"
LORA_RANK = 4

#: What ComfyUI's detection reports for the SD3.5-layout file: SD3.5 Large's layout (RMS-normalised attention
#: queries and keys, no second attention in the image blocks) at a hidden size of 64 x depth = 512.
SD35_TINY_UNET = {
    "in_channels": 16,
    "patch_size": 2,
    "out_channels": 16,
    "depth": 8,
    "input_size": None,
    "adm_in_channels": 768,
    "context_embedder_config": {"target": "torch.nn.Linear", "params": {"in_features": 768, "out_features": 512}},
    "num_patches": 4096,
    "pos_embed_max_size": 64,
    "qk_norm": "rms",
    "pos_embed_scaling_factor": None,
    "x_block_self_attn_layers": [],
}
#: Where each split file's tensors come from in the checkpoint (prefix there -> prefix in the file).
SPLIT_PARTS = {
    SD15_UNET: ("diffusion_models", "model.diffusion_model.", ""),
    SD15_CLIP_L: ("text_encoders", "cond_stage_model.transformer.", ""),
    SD15_VAE: ("vae", "first_stage_model.", ""),
}

# The published SD1.5 UNet hyperparameters (as ComfyUI's detection reports them for real SD1.5 files).
SD15_UNET_CONFIG = {
    "use_checkpoint": False,
    "image_size": 32,
    "out_channels": 4,
    "use_spatial_transformer": True,
    "legacy": False,
    "adm_in_channels": None,
    "in_channels": 4,
    "model_channels": 320,
    "num_res_blocks": [2, 2, 2, 2],
    "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0],
    "channel_mult": [1, 2, 4, 4],
    "transformer_depth_middle": 1,
    "use_linear_in_transformer": False,
    "context_dim": 768,
    "num_heads": 8,
    "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
    "use_temporal_attention": False,
    "use_temporal_resblock": False,
}
SD_VAE = {
    "double_z": True,
    "z_channels": 4,
    "resolution": 256,
    "in_channels": 3,
    "out_ch": 3,
    "ch": 128,
    "ch_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_resolutions": [],
    "dropout": 0.0,
}


def sd15_on_meta() -> tuple[object, object, object]:
    import comfy.ldm.models.autoencoder
    import comfy.model_detection

    with torch.device("meta"):
        config = comfy.model_detection.model_config_from_unet_config(dict(SD15_UNET_CONFIG))
        if config is None or type(config).__name__ != "SD15":
            raise RuntimeError(f"ComfyUI did not recognise the SD1.5 UNet hyperparameters (got {config!r})")
        model = config.get_model({}, "model.diffusion_model.", device=torch.device("meta"))
        clip = config.clip_target().clip(device=torch.device("meta"), dtype=torch.float16)
        vae = comfy.ldm.models.autoencoder.AutoencoderKL(ddconfig=dict(SD_VAE), embed_dim=4)
    return model, clip, vae


def _materialise(key: str, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Small random weights in fp16; integer buffers (CLIP's position ids) keep their meaning."""
    if not like.dtype.is_floating_point:
        return torch.arange(like.numel(), dtype=like.dtype).reshape(like.shape)
    if like.dim() >= 2:
        return (torch.randn(like.shape, generator=generator) * 0.02).to(torch.float16)
    if key.endswith("bias"):
        return torch.zeros(like.shape, dtype=torch.float16)
    return torch.ones(like.shape, dtype=torch.float16)


def _up_to_date(path: Path) -> bool:
    if not path.exists():
        return False
    try:
        with safe_open(str(path), "pt") as handle:
            return (handle.metadata() or {}).get("device_control_fixture") == FIXTURE_VERSION
    except Exception:  # a truncated or foreign file is rebuilt
        return False


def saving_layout(model: object, clip: dict[str, torch.Tensor], vae: dict[str, torch.Tensor]) -> dict:
    """The state dict ComfyUI writes when it saves ``model`` with ``clip`` and ``vae``, on any ComfyUI we test.

    ComfyUI 0.28 made the UNet's state dict the first argument of ``BaseModel.state_dict_for_saving``; before,
    the method read it from the model itself. Feature-detected by the parameter's name, not by version.
    """
    save = model.state_dict_for_saving
    if "unet_state_dict" in inspect.signature(save).parameters:
        return save(model.diffusion_model.state_dict(), clip_state_dict=clip, vae_state_dict=vae)
    return save(clip_state_dict=clip, vae_state_dict=vae)


def make_sd15_checkpoint(target: Path, seed: int = 0) -> Path:
    """Write the synthetic SD1.5 checkpoint to ``target`` unless an up-to-date one is there."""
    import comfy.model_detection

    if _up_to_date(target):
        return target
    model, clip, vae = sd15_on_meta()
    layout = saving_layout(model, clip.state_dict(), vae.state_dict())
    detected = comfy.model_detection.model_config_from_unet(layout, "model.diffusion_model.")
    if type(detected).__name__ != "SD15":
        raise RuntimeError(f"ComfyUI detects the synthetic layout as {type(detected).__name__}, not SD15")
    generator = torch.Generator().manual_seed(seed)
    tensors = {key: _materialise(key, layout[key], generator).contiguous() for key in sorted(layout)}
    _write(target, tensors, {"device_control_fixture": FIXTURE_VERSION, "family": "SD15"})
    return target


def make_sd15_lora(target: Path, seed: int = 1, rank: int = LORA_RANK) -> Path:
    """Write a kohya-style LoRA of ``rank`` for the synthetic SD1.5 (attention and projection layers)."""
    import comfy.lora

    if _up_to_date(target):
        return target
    model, clip, _vae = sd15_on_meta()
    key_map = comfy.lora.model_lora_keys_unet(model, {})
    key_map = comfy.lora.model_lora_keys_clip(clip, key_map)
    unet = {f"diffusion_model.{k}": v for k, v in model.diffusion_model.state_dict().items()}
    weights = {**unet, **clip.state_dict()}
    # ComfyUI maps several spellings to each weight; kohya files use the diffusers-style block names.
    by_target: dict[str, str] = {}
    for name, target_key in sorted(key_map.items()):
        if not name.startswith(("lora_unet_", "lora_te_")) or not isinstance(target_key, str):
            continue
        if not any(part in name for part in ("attn", "proj_in", "proj_out", "mlp")):
            continue
        kohya = name.startswith("lora_te_") or any(b in name for b in ("down_blocks", "mid_block", "up_blocks"))
        if kohya or target_key not in by_target:
            by_target[target_key] = name
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for target_key, name in sorted(by_target.items()):
        shape = weights[target_key].shape
        if len(shape) != 2:
            continue
        out_features, in_features = shape
        tensors[f"{name}.lora_down.weight"] = (torch.randn(rank, in_features, generator=generator) * 0.1).half()
        tensors[f"{name}.lora_up.weight"] = (torch.randn(out_features, rank, generator=generator) * 0.1).half()
        tensors[f"{name}.alpha"] = torch.tensor(float(rank), dtype=torch.float16)
    loaded = comfy.lora.load_lora(tensors, key_map, log_missing=False)
    if len(loaded) * 3 != len(tensors):
        raise RuntimeError(f"ComfyUI maps only {len(loaded)} of {len(tensors) // 3} LoRA layers of the synthetic LoRA")
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target), metadata={"device_control_fixture": FIXTURE_VERSION, "rank": str(rank)})
    log.info("[Device Control] wrote %s (%d layers)", target, len(loaded))
    return target


def make_split_part(checkpoint: Path, target: Path, prefix: str, renamed: str) -> Path:
    """Write the tensors of ``checkpoint`` under ``prefix`` to ``target``, named with ``renamed`` instead."""
    if _up_to_date(target):
        return target
    with safe_open(str(checkpoint), "pt") as handle:
        names = [k for k in handle.keys() if k.startswith(prefix)]  # noqa: SIM118 (a safetensors handle, not a dict)
        tensors = {renamed + k[len(prefix) :]: handle.get_tensor(k) for k in names}
    if not tensors:
        raise RuntimeError(f"{checkpoint.name} has no tensor under {prefix!r}")
    _write(target, tensors, {"device_control_fixture": FIXTURE_VERSION, "part_of": checkpoint.name})
    return target


def make_sd35_tiny(target: Path, seed: int = 2) -> Path:
    """Write the small SD3.5-layout diffusion model, checked against ComfyUI's detection first."""
    import comfy.model_detection

    if _up_to_date(target):
        return target
    with torch.device("meta"):
        config = comfy.model_detection.model_config_from_unet_config(dict(SD35_TINY_UNET))
        model = config.get_model({}, "", device=torch.device("meta"))
    layout = model.diffusion_model.state_dict()
    detected = comfy.model_detection.model_config_from_unet(layout, "")
    if type(detected).__name__ != "SD3" or detected.unet_config != config.unet_config:
        raise RuntimeError(f"ComfyUI detects the SD3.5-layout file as {type(detected).__name__}, not this SD3")
    generator = torch.Generator().manual_seed(seed)
    tensors = {key: _materialise(key, layout[key], generator).contiguous() for key in sorted(layout)}
    _write(target, tensors, {"device_control_fixture": FIXTURE_VERSION, "family": "SD3"})
    return target


def _write(target: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    save_file(tensors, str(partial), metadata=metadata)
    partial.replace(target)
    log.info("[Device Control] wrote %s (%d tensors)", target, len(tensors))


def make_all(*, families: bool = True) -> dict[str, Path]:
    """Make every fixture (cached); return their paths by kind. ``families``: also the SDXL, SD3.5, Flux, Chroma and
    Wan 2.1 files (9 GB, about two minutes the first time); without them, only what the SD1.5 workflows use."""
    import_comfy()
    root = fixtures_dir()
    checkpoint = make_sd15_checkpoint(root / "checkpoints" / SD15_CHECKPOINT)
    parts = {
        name: make_split_part(checkpoint, root / folder / name, prefix, renamed)
        for name, (folder, prefix, renamed) in SPLIT_PARTS.items()
    }
    made = {
        "checkpoint": checkpoint,
        "checkpoint_b": second_name(checkpoint, root / "checkpoints" / SD15_CHECKPOINT_B),
        "lora": make_sd15_lora(root / "loras" / SD15_LORA),
        "unet": parts[SD15_UNET],
        "clip_l": parts[SD15_CLIP_L],
        "vae": parts[SD15_VAE],
        "sd35_tiny": make_sd35_tiny(root / "diffusion_models" / SD35_TINY),
    }
    if families:  # SDXL, SD3.5, Flux, Chroma and Wan 2.1 with their LoRAs, text encoders and VAEs; a Flux GGUF
        made.update(make_family_fixtures(root))
        made["flux_gguf"] = write_gguf(made["flux"], root / "diffusion_models" / FLUX_GGUF, "Q8_0", "flux")
    return made


def second_name(source: Path, target: Path) -> Path:
    """``source`` under another name (a hard link; a copy where the file system has none)."""
    if target.exists() and (target.samefile(source) or target.stat().st_mtime >= source.stat().st_mtime):
        return target
    target.unlink(missing_ok=True)
    try:
        target.hardlink_to(source)
    except OSError:
        shutil.copyfile(source, target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--without-families", action="store_true", help="only the SD1.5 fixtures (not the 9 GB of family models)"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for kind, path in make_all(families=not args.without_families).items():
        log.info("[Device Control] %s: %s", kind, path)


if __name__ == "__main__":
    main()
