"""Text encoders and VAEs for the family fixtures: CLIP-G, the 16-channel VAE, the Wan 2.1 VAE, sparse T5s.

CLIP-G and the two VAEs are full size (ComfyUI builds them from fixed configurations, so there is nothing to
shrink) and synthetic, from ComfyUI's own classes on ``meta``: ``SDXLClipG`` for CLIP-G, and for each VAE the
class ``comfy.sd.VAE`` itself picks when handed the released file's layout (``tests/data``). Each layout is
checked against the released one before writing: ComfyUI must name the same tensors with the same shapes, so
it loads the file with no key missing or left over.

T5-XXL and UMT5-XXL (4.7 B and 5.7 B parameters) are too big to generate; they are written as sparse files
with the released layout (a header, then a hole that reads back as zeros), for tests that read headers, detect
text encoders or size loads. UMT5's ``spiece_model`` tokenizer blob reads back as zeros too, so ComfyUI cannot
build a tokenizer from that file: it is not for encoding prompts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tools.fixture_files import (
    STAMP_KEY,
    FixtureMismatchError,
    is_current,
    layout_on_meta,
    same_shapes,
    write_sparse,
    write_streamed,
)
from tools.runtime import DEFAULT_VERSION

log = logging.getLogger("device_control.tools")


@dataclass(frozen=True)
class PartFixture:
    """A text encoder or VAE file: where it goes and the released layout it must match."""

    key: str
    folder: str
    file: str
    released: str
    seed: int = 0
    version: str = "1"


CLIP_G = PartFixture("clip_g", "text_encoders", "device_control_clip_g.safetensors", "te_clip_g.json", seed=20)
VAES = (
    PartFixture("vae_16ch", "vae", "device_control_vae_16ch.safetensors", "vae_flux_sd3_16ch.json", seed=21),
    PartFixture("wan21_vae", "vae", "device_control_wan21_vae.safetensors", "vae_wan21.json", seed=22),
)
SPARSE_TEXT_ENCODERS = (
    PartFixture("t5xxl_sparse", "text_encoders", "device_control_t5xxl_sparse.safetensors", "te_t5xxl_fp16.json"),
    PartFixture("umt5xxl_sparse", "text_encoders", "device_control_umt5xxl_sparse.safetensors", "te_umt5xxl.json"),
)
#: The VAE class ComfyUI must build for each VAE fixture.
VAE_CLASSES = {"vae_16ch": "AutoencodingEngine", "wan21_vae": "WanVAE"}


def clip_g_layout() -> dict[str, torch.Tensor]:
    """ComfyUI's CLIP-G (``SDXLClipG``) on ``meta``, as a standalone text-encoder file names it.

    Raises:
        FixtureMismatchError: ComfyUI would not detect or fully load the layout as CLIP-G.
    """
    import comfy.sd
    import comfy.sdxl_clip

    with torch.device("meta"):
        model = comfy.sdxl_clip.SDXLClipG(device="meta", dtype=torch.float16)
    layout = {name.removeprefix("transformer."): tensor for name, tensor in model.state_dict().items()}
    detected = comfy.sd.detect_te_model(layout)
    if detected != comfy.sd.TEModel.CLIP_G:
        raise FixtureMismatchError(f"ComfyUI {DEFAULT_VERSION} detects the CLIP-G layout as {detected}, not CLIP_G")
    problems = same_shapes(layout, layout_on_meta(CLIP_G.released))
    if problems:
        raise FixtureMismatchError(f"the CLIP-G layout differs from the released OpenCLIP bigG: {problems[:5]}")
    with torch.device("meta"):
        sdxl = comfy.sdxl_clip.SDXLClipModel(device="meta", dtype=torch.float16)
        missing, _unexpected = sdxl.load_sd(dict(layout))
    if missing:
        raise FixtureMismatchError(f"ComfyUI {DEFAULT_VERSION}'s SDXL CLIP misses {sorted(missing)[:5]} in CLIP-G")
    return layout


def vae_layout(part: PartFixture) -> dict[str, torch.Tensor]:
    """The VAE ``comfy.sd.VAE`` builds for the released layout of ``part``, as its state dict on ``meta``.

    Raises:
        FixtureMismatchError: ComfyUI builds another class, or its VAE's tensors are not the released ones.
    """
    import comfy.sd

    released = layout_on_meta(part.released, torch.float16)
    with torch.device("meta"):
        vae = comfy.sd.VAE(sd=dict(released))
    built, wanted = type(vae.first_stage_model).__name__, VAE_CLASSES[part.key]
    if built != wanted:
        raise FixtureMismatchError(f"ComfyUI {DEFAULT_VERSION} builds a {built} for {part.file}, not {wanted}")
    layout = vae.first_stage_model.state_dict()
    problems = same_shapes(layout, released)
    if problems:
        raise FixtureMismatchError(f"ComfyUI {DEFAULT_VERSION}'s {built} differs from the released VAE: {problems[:5]}")
    return layout


def check_sparse(part: PartFixture) -> None:
    """Check that ComfyUI detects the released layout of ``part`` as T5-XXL (UMT5 is a T5-XXL to it)."""
    import comfy.sd

    detected = comfy.sd.detect_te_model(layout_on_meta(part.released))
    if detected != comfy.sd.TEModel.T5_XXL:
        raise FixtureMismatchError(f"ComfyUI {DEFAULT_VERSION} detects {part.released} as {detected}, not T5_XXL")


def _metadata(part: PartFixture, **extra: str) -> dict[str, str]:
    return {STAMP_KEY: part.version, "layout": part.released, **extra}


def make_part(part: PartFixture, root: Path) -> Path:
    """Write ``part`` under ``root`` unless a file with its version stamp is there."""
    target = root / part.folder / part.file
    if is_current(target, part.version):
        return target
    if part in SPARSE_TEXT_ENCODERS:
        check_sparse(part)
        return write_sparse(target, part.released, _metadata(part, sparse="data is a hole: reads as zeros"))
    layout = clip_g_layout() if part is CLIP_G else vae_layout(part)
    return write_streamed(target, layout, _metadata(part, seed=str(part.seed)), part.seed)


def make_family_parts(root: Path) -> dict[str, Path]:
    """Every text encoder and VAE fixture of the families, cached; their paths by ``make_all()`` key."""
    return {part.key: make_part(part, root) for part in (CLIP_G, *VAES, *SPARSE_TEXT_ENCODERS)}
