"""Files the row-slice integration tests use beside the fixtures, in a folder of the test session (nothing is
committed): the Flux-layout diffusion model the issue describes, LoRAs for any diffusion-model file, and a
test-only custom node that makes a text conditioning of any width.

* The Flux-layout model is the Flux family fixture (``tools.fixtures.families``): FLUX.1-dev's layout (hidden
  size 3072) cut to one double and one single block, 2.05 GiB in fp32, 23 Linear layers of up to 264 MB, its
  pooled input 2048 wide (the width of SD3's two CLIP encoders, which its family tests condition it with). The
  folder links it under its own name, and the running ComfyUI's detection is checked to name it Flux each time.
* A LoRA for a diffusion-model file has a rank-4 factor pair for every matrix, in the generic naming every ComfyUI
  maps (``diffusion_model.<weight>``); for Flux, the first double block's attention also in diffusers naming
  (``transformer.transformer_blocks.0.attn.to_q``...), which ComfyUI maps to parts of the fused qkv weight (patches
  with offsets).
* The custom node exists because a Flux layout needs a 4096-wide text conditioning (its T5 width, fixed by
  ComfyUI 0.3.52's detection) and no text encoder that small exists: the node draws one from a seed.

Run with the runtime's Python from the repository: ``python -m tests.slice_models FOLDER FLUX_FILE [SD35_FILE]``
writes them all (and a LoRA for the SD3.5-layout fixture when its file is given). The LoRAs are made once per
layout and seed in the runtime's ``fixtures/slices`` (each ComfyUI version's pass links them).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tools.fixtures.files import file_on_meta
from tools.runtime.provision import fixtures_dir

FLUX_FILE = "device_control_flux_3072_1x1.safetensors"
#: Part of every cached file's name: raise it when what a file holds for a layout and seed changes.
CACHE_VERSION = 1

CONDITIONING_NODE = '''"""Test-only: a text conditioning of any width, drawn from a seed."""

import torch


class DeviceControlTestConditioning:
    @classmethod
    def INPUT_TYPES(cls):
        number = ("INT", {"default": 1, "min": 0, "max": 1 << 20})
        return {"required": {"tokens": number, "width": number, "pooled": number, "seed": number}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "testing"

    def make(self, tokens, width, pooled, seed):
        generator = torch.Generator().manual_seed(seed)
        cond = torch.randn(1, tokens, width, generator=generator)
        return ([[cond, {"pooled_output": torch.randn(1, pooled, generator=generator)}]],)


NODE_CLASS_MAPPINGS = {"DeviceControlTestConditioning": DeviceControlTestConditioning}
'''


def _linked(target: Path, key: str, build: Callable[[Path], None]) -> Path:
    """``target`` as a link to the cached file for ``key``, which ``build`` writes when it is not there yet."""
    cached = fixtures_dir() / "slices" / f"{key}_v{CACHE_VERSION}.safetensors"
    if not cached.exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(".partial")
        build(partial)
        partial.replace(cached)  # whole or absent: an interrupted run leaves no half file behind
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    target.symlink_to(cached)
    return target


def _digest(shapes: dict[str, tuple[int, ...]]) -> str:
    return hashlib.sha256(repr(sorted(shapes.items())).encode()).hexdigest()[:16]


def link_flux(family_file: Path, target: Path) -> Path:
    """``target`` as a link to the Flux family fixture, checked against the running ComfyUI's detection."""
    from tools.runtime.inprocess import import_comfy

    import_comfy()
    import comfy.model_detection

    detected = comfy.model_detection.model_config_from_unet(file_on_meta(family_file), "")
    if type(detected).__name__ != "Flux":
        raise RuntimeError(f"ComfyUI detects {family_file.name} as {type(detected).__name__}, not Flux")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    target.symlink_to(family_file)
    return target


def make_lora(model_file: Path, target: Path, seed: int = 5, flux_diffusers: bool = False) -> Path:
    """Write a rank-4 LoRA for every matrix of ``model_file`` (see the module's docstring)."""
    with safe_open(str(model_file), "pt") as handle:
        shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118
    key = f"lora_{_digest(shapes)}_seed{seed}{'_diffusers' if flux_diffusers else ''}"
    return _linked(target, key, lambda path: _write_lora(shapes, path, seed, flux_diffusers))


def _write_lora(shapes: dict[str, tuple[int, ...]], target: Path, seed: int, flux_diffusers: bool) -> None:
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}

    def pair(name: str, rows: int, columns: int, up: str, down: str) -> None:
        tensors[f"{name}.{up}.weight"] = torch.randn(rows, 4, generator=generator) * 0.05
        tensors[f"{name}.{down}.weight"] = torch.randn(4, columns, generator=generator) * 0.05

    for key, shape in shapes.items():
        if key.endswith(".weight") and len(shape) == 2:
            name = f"diffusion_model.{key.removesuffix('.weight')}"
            pair(name, shape[0], shape[1], "lora_up", "lora_down")
            tensors[f"{name}.alpha"] = torch.tensor(4.0)
    if flux_diffusers:
        for part in ("to_q", "to_k", "to_v"):
            pair(f"transformer.transformer_blocks.0.attn.{part}", 3072, 3072, "lora_B", "lora_A")
    save_file({k: v.to(torch.float16).contiguous() for k, v in tensors.items()}, str(target))


def write_conditioning_node(folder: Path) -> Path:
    """Write the test-only conditioning node into ``folder`` (a ComfyUI ``custom_nodes`` folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "device_control_test_conditioning.py"
    path.write_text(CONDITIONING_NODE)
    return path


FLUX_LORA = "device_control_flux_lora.safetensors"
SD35_LORA = "device_control_sd35_tiny_lora.safetensors"


def main() -> None:
    """``FOLDER FLUX_FILE [SD35_FILE]``: the Flux-layout model and its LoRA, the node, and a LoRA for the SD3.5
    fixture."""
    folder = Path(sys.argv[1])
    flux = link_flux(Path(sys.argv[2]), folder / "diffusion_models" / FLUX_FILE)
    make_lora(flux, folder / "loras" / FLUX_LORA, flux_diffusers=True)
    if len(sys.argv) > 3:
        make_lora(Path(sys.argv[3]), folder / "loras" / SD35_LORA)
    write_conditioning_node(folder / "custom_nodes")


if __name__ == "__main__":
    main()
