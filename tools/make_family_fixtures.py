"""Synthetic diffusion models of the SDXL, SD3.5, Flux, Chroma and Wan 2.1 families, with a LoRA for each.

Each model is built from ComfyUI's own classes on torch's ``meta`` device, in the layout ComfyUI itself loads.
ComfyUI's detection decides what a file is from the shapes of a few tensors and fixes the rest (Flux's hidden
size is 3072 in ComfyUI 0.3.52 whatever the file holds; SDXL's channels and depth are fixed outright), so we
describe each model by a *sketch*: the tensors its detection reads, with the sizes we choose where ComfyUI lets
us choose. The running ComfyUI turns the sketch into its own configuration (its keys differ between versions),
builds the model from it, and its ``state_dict()`` is the file's layout. Before writing, that layout goes back
through ComfyUI's detection, which must name the intended class with the same configuration and load every
tensor; otherwise :class:`~tools.fixture_files.FixtureMismatchError` says what differs.

Text encoders and VAEs for these models are in :mod:`tools.make_family_parts`; :data:`CONDITIONING` records what
each model needs, for tests that assemble workflows. Run ``.runtime/venv/bin/python -m tools.make_fixtures``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tools.fixture_files import (
    STAMP_KEY,
    FixtureMismatchError,
    is_current,
    layout_on_meta,
    same_shapes,
    write_small,
    write_streamed,
)
from tools.runtime import DEFAULT_VERSION

log = logging.getLogger("device_control.tools")

LORA_RANK = 4


@dataclass(frozen=True)
class Conditioning:
    """What a diffusion model fixture needs to sample, for the tests that build its workflow.

    Attributes:
        context_dim: per-token text features its cross-attention (or text input layer) takes.
        pooled_dim: width of the pooled text vector it takes (SDXL's ``adm``, SD3's ``y``, Flux's ``vector_in``);
            ``None`` where it takes none.
        clip_type: the ``CLIPLoader`` type whose output has those widths, with ``text_encoders``.
        text_encoders: ``make_all()`` keys of the text encoder files to load with ``clip_type``.
        vae: ``make_all()`` key of the VAE that decodes its latent.
        latent_channels: channels of its latent.
        video: its latent is 5-D (batch, channels, frames, height, width), frames = 1 + (video frames - 1) / 4.
        guidance: it takes a distilled guidance value (Flux dev's ``guidance_in``).
    """

    context_dim: int
    pooled_dim: int | None
    clip_type: str
    text_encoders: tuple[str, ...]
    vae: str
    latent_channels: int
    video: bool = False
    guidance: bool = False


@dataclass(frozen=True)
class DiffusionFixture:
    """One synthetic diffusion model: its file, what ComfyUI must detect it as, and how it is made."""

    key: str
    file: str
    comfy_class: str
    sketch: Callable[[], dict[str, list[int]]]
    #: Module paths (no ``.weight``) the LoRA adapts (a pattern): the attention and MLP linears, or fewer.
    lora_modules: str
    conditioning: Conditioning
    seed: int
    version: str = "1"
    #: The LoRA's own version stamp (a LoRA can change without writing its model again).
    lora_version: str = "1"
    #: Released files name the Flux family's RMS-norm gains ``scale``; ComfyUI 0.28 calls them ``weight`` and
    #: renames on load, earlier versions only read ``scale``. Files use the released names.
    released_names: tuple[tuple[str, str], ...] = ()

    @property
    def lora_key(self) -> str:
        return f"lora_{self.key.removesuffix('_unet')}"

    @property
    def lora_file(self) -> str:
        return f"{self.file.removesuffix('.safetensors')}_lora_r{LORA_RANK}.safetensors"


def _sdxl_sketch() -> dict[str, list[int]]:
    """SDXL 1.0 base as released: ComfyUI's detection reads nearly every tensor of a UNet."""
    return {name: list(t.shape) for name, t in layout_on_meta("sdxl_base.diffusion_model.json").items()}


#: Transformer blocks kept per spatial transformer of SDXL's UNet, by the blocks it has as released: Segmind Vega's
#: depth (1 at the 640-channel level, 2 at the 1280-channel one), an SDXL distillation ComfyUI builds as SDXL.
_VEGA_DEPTH = {2: 1, 10: 2}


def _sdxl_vega_sketch() -> dict[str, list[int]]:
    """SDXL 1.0 base as released with its transformers cut to Segmind Vega's depth (0.85 of 2.57 billion weights
    left): ComfyUI detects it as ``Segmind_Vega``, a subclass of its SDXL class with SDXL's conditioning, latent
    and sampling, built from the same openaimodel code. What the full size proved on a CPU was only that it is
    large; the tests that need a model larger than a GPU size their simulated GPUs by it."""
    full = _sdxl_sketch()
    depth: dict[str, int] = {}
    for name in full:
        found = re.match(r"(.*\.transformer_blocks)\.(\d+)\.", name)
        if found:
            depth[found[1]] = max(depth.get(found[1], 0), int(found[2]) + 1)

    def kept(name: str) -> bool:
        found = re.match(r"(.*\.transformer_blocks)\.(\d+)\.", name)
        return found is None or int(found[2]) < _VEGA_DEPTH[depth[found[1]]]

    return {name: shape for name, shape in full.items() if kept(name)}


def _sd35_sketch(depth: int = 4) -> dict[str, list[int]]:
    """SD3.5 Large's layout (RMS-normalised q/k, no second image attention) at hidden 64 x ``depth``, with its
    real text inputs (T5-width context, CLIP-L+G pooled vector) and position table (192 x 192 patches)."""
    hidden = 64 * depth
    sketch = {
        "x_embedder.proj.weight": [hidden, 16, 2, 2],
        "final_layer.linear.weight": [2 * 2 * 16, hidden],
        "y_embedder.mlp.0.weight": [hidden, 2048],
        "context_embedder.weight": [hidden, 4096],
        "pos_embed": [1, 192 * 192, hidden],
        "joint_blocks.0.context_block.attn.ln_q.weight": [64],
    }
    for block in range(depth):
        sketch[f"joint_blocks.{block}.context_block.attn.qkv.weight"] = [3 * hidden, hidden]
    return sketch


def _flux_sketch() -> dict[str, list[int]]:
    """Flux.1 dev at ComfyUI's fixed width (3072), one double and one single block, pooled input 2048 wide."""
    return {
        "img_in.weight": [3072, 64],
        "txt_in.weight": [3072, 4096],
        "vector_in.in_layer.weight": [3072, 2048],
        "guidance_in.in_layer.weight": [3072, 256],
        "double_blocks.0.img_attn.norm.key_norm.scale": [128],
        "single_blocks.0.norm.key_norm.scale": [128],
    }


def _chroma_sketch() -> dict[str, list[int]]:
    """Chroma: Flux without pooled or guidance input, modulated by its distilled guidance network."""
    return {
        "img_in.weight": [3072, 64],
        "txt_in.weight": [3072, 4096],
        "double_blocks.0.img_attn.norm.key_norm.scale": [128],
        "single_blocks.0.norm.key_norm.scale": [128],
        "distilled_guidance_layer.norms.0.scale": [5120],
    }


def _wan21_sketch(dim: int = 256, ffn: int = 512, blocks: int = 2) -> dict[str, list[int]]:
    """Wan 2.1 text-to-video, reduced: ComfyUI reads the width from ``head.modulation`` (heads = width / 128)."""
    sketch = {
        "head.modulation": [1, 2, dim],
        "head.head.weight": [16 * 1 * 2 * 2, dim],
        "patch_embedding.weight": [dim, 16, 1, 2, 2],
    }
    for block in range(blocks):
        sketch[f"blocks.{block}.ffn.0.weight"] = [ffn, dim]
    return sketch


_FLUX_SCALES = ((r"((?:query|key)_norm|norms\.\d+)\.weight$", r"\1.scale"),)
_SD3_CLIP = Conditioning(4096, 2048, "sd3", ("clip_l", "clip_g"), "vae_16ch", 16)

# Self-attention only: ComfyUI patching an fp32 UNet on the CPU keeps the weights a LoRA covers twice (backup and
# patched); over every linear of the full-size UNet that is 18 GiB at once, which a 24 GB machine cannot spare.
_SDXL_LORA = r"transformer_blocks\.\d+\.attn1\.(to_[qkv]|to_out\.0)$"
_SDXL_CONDITIONING = Conditioning(2048, 1280, "sdxl", ("clip_l", "clip_g"), "vae", 4)
#: SDXL 1.0 base's UNet at full size and in its released layout, for the GPU benchmarks (``tools/bench_gpu_*``),
#: which measure streaming at SDXL's real size; the test suite's SDXL is the smaller ``sdxl_unet`` below.
SDXL_FULL_SIZE = DiffusionFixture(
    "sdxl_unet_full",
    "device_control_sdxl_unet.safetensors",
    "SDXL",
    _sdxl_sketch,
    _SDXL_LORA,
    _SDXL_CONDITIONING,
    seed=10,
    lora_version="4",
)

#: The diffusion-model fixtures, by ``make_all()`` key.
DIFFUSION_FIXTURES = {
    fixture.key: fixture
    for fixture in (
        DiffusionFixture(
            "sdxl_unet",
            "device_control_sdxl_vega.safetensors",
            "Segmind_Vega",
            _sdxl_vega_sketch,
            _SDXL_LORA,
            _SDXL_CONDITIONING,
            seed=10,
        ),
        DiffusionFixture(
            "sd35",
            "device_control_sd35_large_d4.safetensors",
            "SD3",
            _sd35_sketch,
            r"joint_blocks\.\d+\.(context|x)_block\.(attn\.(qkv|proj)|mlp\.fc[12])$",
            _SD3_CLIP,
            seed=11,
        ),
        DiffusionFixture(
            "flux",
            "device_control_flux_dev_d1.safetensors",
            "Flux",
            _flux_sketch,
            r"(double_blocks\.\d+\.(img|txt)_(attn\.(qkv|proj)|mlp\.[02])|single_blocks\.\d+\.linear[12])$",
            Conditioning(4096, 2048, "sd3", ("clip_l", "clip_g"), "vae_16ch", 16, guidance=True),
            seed=12,
            released_names=_FLUX_SCALES,
        ),
        DiffusionFixture(
            "chroma",
            "device_control_chroma_d1.safetensors",
            "Chroma",
            _chroma_sketch,
            r"(double_blocks\.\d+\.(img|txt)_(attn\.(qkv|proj)|mlp\.[02])|single_blocks\.\d+\.linear[12])$",
            Conditioning(4096, None, "sd3", ("clip_l", "clip_g"), "vae_16ch", 16),
            seed=13,
            released_names=_FLUX_SCALES,
        ),
        DiffusionFixture(
            "wan21",
            "device_control_wan21_t2v_small.safetensors",
            "WAN21_T2V",
            _wan21_sketch,
            r"blocks\.\d+\.((self|cross)_attn\.[qkvo]|ffn\.[02])$",
            Conditioning(4096, None, "sd3", ("clip_l", "clip_g"), "wan21_vae", 16, video=True),
            seed=14,
        ),
    )
}
#: What each diffusion model needs to sample (see :class:`Conditioning`), by ``make_all()`` key. The SD3-type
#: CLIP output (CLIP-L alone, or CLIP-L + CLIP-G) is 4096 wide per token (zero-padded) with a 2048-wide pooled
#: vector, so it drives SD3.5, Flux (pooled input sized 2048 for it), Chroma and Wan alike; their real text
#: encoders (T5-XXL, UMT5-XXL) are the sparse shape-only files.
CONDITIONING = {key: fixture.conditioning for key, fixture in DIFFUSION_FIXTURES.items()}


def _released(fixture: DiffusionFixture, name: str) -> str:
    for pattern, replacement in fixture.released_names:
        name = re.sub(pattern, replacement, name)
    return name


def build_on_meta(fixture: DiffusionFixture) -> tuple[object, dict[str, torch.Tensor]]:
    """The running ComfyUI's model for ``fixture`` on ``meta``, and the file layout (released names).

    Raises:
        FixtureMismatchError: ComfyUI does not read the sketch or the layout as ``fixture.comfy_class``.
    """
    import comfy.model_detection as detection

    sketch = {name: torch.empty(shape, device="meta") for name, shape in fixture.sketch().items()}
    unet_config = detection.detect_unet_config(sketch, "")
    with torch.device("meta"):
        config = detection.model_config_from_unet_config(unet_config, sketch)
        if config is None:
            raise FixtureMismatchError(f"ComfyUI {DEFAULT_VERSION} matches no model class to {fixture.key}'s sketch")
        model = config.get_model(sketch, "", device=torch.device("meta"))
    layout = {_released(fixture, k): v for k, v in model.diffusion_model.state_dict().items()}
    check_layout(fixture, layout)
    return model, layout


def check_layout(fixture: DiffusionFixture, layout: dict[str, torch.Tensor]) -> object:
    """Check that ComfyUI detects ``layout`` as ``fixture.comfy_class`` and loads all of it; return its config.

    Raises:
        FixtureMismatchError: naming the class ComfyUI saw, or the tensors it would not load or miss.
    """
    import comfy.model_detection as detection

    detected = detection.model_config_from_unet(layout, "")
    seen = type(detected).__name__ if detected is not None else "nothing"
    if seen != fixture.comfy_class:
        raise FixtureMismatchError(
            f"ComfyUI {DEFAULT_VERSION} detects {fixture.file} as {seen}, not {fixture.comfy_class}"
        )
    with torch.device("meta"):
        model = detected.get_model(layout, "", device=torch.device("meta"))
    wanted = model.diffusion_model.state_dict()
    loaded = detected.process_unet_state_dict(dict(layout))
    problems = same_shapes(loaded, wanted)
    if problems:
        raise FixtureMismatchError(f"ComfyUI {DEFAULT_VERSION} would not load {fixture.file} whole: {problems[:5]}")
    return detected


def make_diffusion_model(fixture: DiffusionFixture, target: Path) -> Path:
    """Write ``fixture`` to ``target`` unless a file with its version stamp is there."""
    if is_current(target, fixture.version):
        return target
    _model, layout = build_on_meta(fixture)
    if fixture is SDXL_FULL_SIZE:
        problems = same_shapes(layout, layout_on_meta("sdxl_base.diffusion_model.json"))
        if problems:
            raise FixtureMismatchError(f"the SDXL layout differs from the released SDXL 1.0 base: {problems[:5]}")
    metadata = {STAMP_KEY: fixture.version, "family": fixture.comfy_class, "seed": str(fixture.seed)}
    return write_streamed(target, layout, metadata, fixture.seed)


def lora_tensors(fixture: DiffusionFixture, model: object, seed: int) -> dict[str, torch.Tensor]:
    """A rank-4 LoRA for ``model``'s attention and MLP linears, named ``diffusion_model.<module>.lora_*``."""
    pattern = re.compile(fixture.lora_modules)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, weight in sorted(model.diffusion_model.state_dict().items()):
        module = name.removesuffix(".weight")
        if module == name or weight.dim() != 2 or not pattern.search(module):
            continue
        out_features, in_features = weight.shape
        stem = f"diffusion_model.{module}"
        tensors[f"{stem}.lora_down.weight"] = (torch.randn(LORA_RANK, in_features, generator=generator) * 0.1).half()
        tensors[f"{stem}.lora_up.weight"] = (torch.randn(out_features, LORA_RANK, generator=generator) * 0.1).half()
        tensors[f"{stem}.alpha"] = torch.tensor(float(LORA_RANK), dtype=torch.float16)
    return tensors


def check_lora(fixture: DiffusionFixture, model: object, tensors: dict[str, torch.Tensor]) -> int:
    """How many layers ComfyUI's LoRA loader maps for ``model``; raises unless it maps every key of ``tensors``.

    Raises:
        FixtureMismatchError: naming the LoRA layers ComfyUI would skip.
    """
    import comfy.lora

    key_map = comfy.lora.model_lora_keys_unet(model, {})
    loaded = comfy.lora.load_lora(tensors, key_map, log_missing=False)
    layers = {name.rsplit(".lora_", 1)[0].removesuffix(".alpha") for name in tensors}
    unmapped = sorted(layer for layer in layers if key_map.get(layer) not in loaded)
    if unmapped or not layers:
        raise FixtureMismatchError(
            f"ComfyUI {DEFAULT_VERSION} maps {len(loaded)} of {len(layers)} layers of {fixture.lora_file}; "
            f"not: {unmapped[:5]}"
        )
    return len(loaded)


def make_lora(fixture: DiffusionFixture, target: Path, model: object | None = None) -> Path:
    """Write ``fixture``'s LoRA to ``target`` unless a file with its version stamp is there."""
    if is_current(target, fixture.lora_version):
        return target
    if model is None:
        model, _layout = build_on_meta(fixture)
    tensors = lora_tensors(fixture, model, fixture.seed + 100)
    layers = check_lora(fixture, model, tensors)
    metadata = {STAMP_KEY: fixture.lora_version, "family": fixture.comfy_class, "rank": str(LORA_RANK)}
    write_small(target, tensors, metadata)
    log.info("[Device Control] %s: %d LoRA layers, all mapped by ComfyUI", target.name, layers)
    return target


def make_family_fixtures(root: Path) -> dict[str, Path]:
    """Make every family fixture under ``root`` (the runtime's ``fixtures/``), cached; return paths by key."""
    from tools.make_family_parts import make_family_parts

    made: dict[str, Path] = {}
    for key, fixture in DIFFUSION_FIXTURES.items():
        made[key] = make_diffusion_model(fixture, root / "diffusion_models" / fixture.file)
        made[fixture.lora_key] = make_lora(fixture, root / "loras" / fixture.lora_file)
    made.update(make_family_parts(root))
    return made
