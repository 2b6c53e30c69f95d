"""Make the synthetic test checkpoints: an architecturally real SD1.5 checkpoint and a LoRA for it.

No model hub is reachable from CI, and real weights must never be committed. So we build ComfyUI's own
SD1.5 classes on torch's ``meta`` device (no memory), take the key layout ComfyUI itself writes when it
saves a checkpoint (``state_dict_for_saving``), fill it with small seeded random weights (N(0, 0.02) for
matrices and kernels, 1 for norm scales, 0 for biases: pure zeros would give degenerate images), check
with ComfyUI's detection that it is SD1.5, and write fp16 safetensors. The LoRA is rank 4, in kohya
naming, built from ComfyUI's own LoRA key maps for that model and checked to load every key.

Files are cached in the runtime's ``fixtures/`` folder and rebuilt only when :data:`FIXTURE_VERSION`
changes. Run with the runtime's Python: ``.runtime/venv/bin/python -m tools.make_fixtures``.
"""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tools.comfy_inprocess import import_comfy
from tools.runtime import fixtures_dir

log = logging.getLogger("device_control.tools")

FIXTURE_VERSION = "1"
SD15_CHECKPOINT = "device_control_sd15_synthetic.safetensors"
SD15_LORA = "device_control_sd15_lora_r4.safetensors"
#: A second checkpoint name for two-model workflows: a hard link to the first (two models in memory, one file).
SD15_CHECKPOINT_B = "device_control_sd15_synthetic_b.safetensors"
LORA_RANK = 4

# The published SD1.5 UNet hyperparameters (as ComfyUI's detection reports them for real SD1.5 files).
SD15_UNET = {
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


def _sd15_on_meta() -> tuple[object, object, object]:
    import comfy.ldm.models.autoencoder
    import comfy.model_detection

    with torch.device("meta"):
        config = comfy.model_detection.model_config_from_unet_config(dict(SD15_UNET))
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


def make_sd15_checkpoint(target: Path, seed: int = 0) -> Path:
    """Write the synthetic SD1.5 checkpoint to ``target`` unless an up-to-date one is there."""
    import comfy.model_detection

    if _up_to_date(target):
        return target
    model, clip, vae = _sd15_on_meta()
    layout = model.state_dict_for_saving(clip.state_dict(), vae.state_dict())
    detected = comfy.model_detection.model_config_from_unet(layout, "model.diffusion_model.")
    if type(detected).__name__ != "SD15":
        raise RuntimeError(f"ComfyUI detects the synthetic layout as {type(detected).__name__}, not SD15")
    generator = torch.Generator().manual_seed(seed)
    tensors = {key: _materialise(key, layout[key], generator).contiguous() for key in sorted(layout)}
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    save_file(tensors, str(partial), metadata={"device_control_fixture": FIXTURE_VERSION, "family": "SD15"})
    partial.replace(target)
    log.info("[Device Control] wrote %s (%d tensors)", target, len(tensors))
    return target


def make_sd15_lora(target: Path, seed: int = 1, rank: int = LORA_RANK) -> Path:
    """Write a kohya-style LoRA of ``rank`` for the synthetic SD1.5 (attention and projection layers)."""
    import comfy.lora

    if _up_to_date(target):
        return target
    model, clip, _vae = _sd15_on_meta()
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


def make_all() -> dict[str, Path]:
    """Make every fixture (cached); return their paths by kind."""
    import_comfy()
    root = fixtures_dir()
    checkpoint = make_sd15_checkpoint(root / "checkpoints" / SD15_CHECKPOINT)
    return {
        "checkpoint": checkpoint,
        "checkpoint_b": second_name(checkpoint, root / "checkpoints" / SD15_CHECKPOINT_B),
        "lora": make_sd15_lora(root / "loras" / SD15_LORA),
    }


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
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for kind, path in make_all().items():
        log.info("[Device Control] %s: %s", kind, path)


if __name__ == "__main__":
    main()
