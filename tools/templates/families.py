"""The example workflows of the model families that ship as separate files: SDXL, SD3.5, Flux, Chroma and Wan 2.1.

Each is what a 12 GB card wants: the diffusion model read into RAM in the dtype that suits it, then moved to
``gpu:0`` under a budget by Move To GPU (what does not fit streams from RAM at each step); the text encoders on
the CPU; the VAE on ``gpu:0``, where it decodes. Each family has two sides: :class:`Released`, what the workflow
file names and how it samples (the released files, at the settings of ComfyUI's own examples), and the synthetic
files the tests generate (``tools/fixtures/families.py``), whose text conditioning comes from CLIP-L (and CLIP-G
for SDXL) loaded as ComfyUI's ``sd3`` type (``sdxl`` for SDXL). ``tools.templates.workflow_api.for_fixtures`` turns the
first into the second.
"""

from __future__ import annotations

from dataclasses import dataclass

from tools.fixtures.families import DIFFUSION_FIXTURES
from tools.fixtures.family_parts import CLIP_G, VAES
from tools.fixtures.gguf_files import FLUX_GGUF
from tools.fixtures.make import SD15_CLIP_L, SD15_VAE

NOTE_SIZE = (420, 220)


@dataclass(frozen=True)
class Released:
    """What a family's workflow file names and how it samples: the released files (``tools.templates.models``), the
    latent's width, height (and frames), and the steps and cfg of ComfyUI's own example for that model."""

    unet: str
    text_encoders: tuple[str, ...]
    clip_type: str
    vae: str
    size: tuple[int, ...]
    steps: int
    cfg: float


@dataclass(frozen=True)
class Family:
    """One family's example: its test files, how its diffusion model is placed, how it samples, and its release."""

    stem: str  # a short name: the prefix of the images it saves, the id of its tests
    title: str  # the workflow's file name, which the template browser shows as its title
    unet: str
    dtype: str
    budget: str
    text_encoders: tuple[str, ...]
    clip_type: str
    vae: str
    latent: tuple[str, list]
    sampler: tuple[str, str]
    note: str
    released: Released
    guidance: bool = False


def _vae(key: str) -> str:
    return next(part.file for part in VAES if part.key == key)


_CLIP_PAIR = (SD15_CLIP_L, CLIP_G.file)
_SD3_LATENT = ("EmptySD3LatentImage", [64, 64, 1])
_FLUX_TE = ("clip_l.safetensors", "t5xxl_fp8_e4m3fn.safetensors")
_FLUX = Released("flux1-dev.safetensors", _FLUX_TE, "flux", "ae.safetensors", (1024, 1024), 20, 1.0)

FAMILIES = (
    Family(
        "09_sdxl_split_files_unet_on_gpu",
        "09 SDXL from separate files - UNet on the GPU",
        DIFFUSION_FIXTURES["sdxl_unet"].file,
        "fp16",
        "8GB",
        _CLIP_PAIR,
        "sdxl",
        SD15_VAE,
        ("EmptyLatentImage", [64, 64, 1]),
        ("euler", "normal"),
        "SDXL base in separate files, no login needed: its UNet, sdxl_unet_fp16 (5.1 GB to download), in "
        "models/diffusion_models; clip_l (0.25 GB to download) and clip_g (1.4 GB to download) in models/text_encoders "
        "(type sdxl); sdxl_vae (0.34 GB to download) in models/vae. The UNet fits an 8 GB budget whole.",
        Released(
            "sdxl_unet_fp16.safetensors",
            ("clip_l.safetensors", "clip_g.safetensors"),
            "sdxl",
            "sdxl_vae.safetensors",
            (1024, 1024),
            25,
            7.0,
        ),
    ),
    Family(
        "13_sd35_split_files_fp8_budget",
        "13 SD3.5 from separate files - fp8 under a VRAM budget",
        DIFFUSION_FIXTURES["sd35"].file,
        "fp8_e4m3fn",
        "7GB",
        (SD15_CLIP_L,),
        "sd3",
        _vae("vae_16ch"),
        _SD3_LATENT,
        ("euler", "simple"),
        "SD3.5 Large in separate files: sd3.5_large (16.3 GB to download; log in to Hugging Face and accept the "
        "licence on its page first; 7.6 GiB in memory as fp8) in models/diffusion_models; clip_l, clip_g and "
        "t5xxl_fp8_e4m3fn_scaled (4.9 GB to download) in models/text_encoders (type sd3), on the CPU; the SD3.5 VAE "
        "in models/vae. A 7 GB budget keeps most of the model on the GPU and streams the rest each step.",
        Released(
            "sd3.5_large.safetensors",
            ("clip_l.safetensors", "clip_g.safetensors", "t5xxl_fp8_e4m3fn_scaled.safetensors"),
            "sd3",
            "sd3.5_vae.safetensors",
            (1024, 1024),
            30,
            4.5,
        ),
    ),
    Family(
        "10_flux_split_files_fp8_budget",
        "10 Flux dev from separate files - fp8 under a VRAM budget",
        DIFFUSION_FIXTURES["flux"].file,
        "fp8_e4m3fn",
        "9GB",
        (SD15_CLIP_L,),
        "sd3",
        _vae("vae_16ch"),
        _SD3_LATENT,
        ("euler", "simple"),
        "Flux.1 dev in separate files: flux1-dev (23.8 GB to download; log in to Hugging Face and accept the "
        "licence on its page first; 11.1 GiB in memory as fp8) in models/diffusion_models; clip_l and "
        "t5xxl_fp8_e4m3fn (4.9 GB to download) in models/text_encoders (type flux), on the CPU; ae (0.34 GB to "
        "download) in models/vae. A 9 GB budget leaves room on a 12 GB card for the activations; the rest streams "
        "each step. For Flux.1 schnell: 4 steps.",
        _FLUX,
        guidance=True,
    ),
    Family(
        "14_chroma_split_files_fp8_budget",
        "14 Chroma from separate files - fp8 under a VRAM budget",
        DIFFUSION_FIXTURES["chroma"].file,
        "fp8_e4m3fn",
        "8GB",
        (SD15_CLIP_L,),
        "sd3",
        _vae("vae_16ch"),
        _SD3_LATENT,
        ("euler", "simple"),
        "Chroma in separate files, no login needed: Chroma1-HD (17.8 GB to download; 8.3 GiB in memory as fp8) in "
        "models/diffusion_models; t5xxl_fp8_e4m3fn (4.9 GB to download) in models/text_encoders (type chroma), on "
        "the CPU; the Flux ae (0.34 GB to download) in models/vae.",
        Released(
            "Chroma1-HD.safetensors",
            ("t5xxl_fp8_e4m3fn.safetensors",),
            "chroma",
            "ae.safetensors",
            (1024, 1024),
            26,
            4.0,
        ),
    ),
    Family(
        "15_wan21_split_files_fp8_budget",
        "15 Wan 2.1 from separate files - fp8 under a VRAM budget",
        DIFFUSION_FIXTURES["wan21"].file,
        "fp8_e4m3fn",
        "9GB",
        (SD15_CLIP_L,),
        "sd3",
        _vae("wan21_vae"),
        ("EmptyHunyuanLatentVideo", [64, 64, 5, 1]),
        ("euler", "simple"),
        "Wan 2.1 text-to-video in separate files, 33 frames at 832x480 saved as images, no login needed: "
        "wan2.1_t2v_14B_fp8_e4m3fn (14.3 GB to download; 13.3 GiB in memory, more than the card holds) in "
        "models/diffusion_models; umt5_xxl in models/text_encoders (type wan), on the CPU; wan_2.1_vae (0.25 GB to "
        "download) in models/vae. A 9 GB budget keeps about two thirds of the model on the GPU and streams the rest "
        "each step.",
        Released(
            "wan2.1_t2v_14B_fp8_e4m3fn.safetensors",
            ("umt5_xxl_fp8_e4m3fn_scaled.safetensors",),
            "wan",
            "wan_2.1_vae.safetensors",
            (832, 480, 33),
            30,
            6.0,
        ),
    ),
)

#: The GGUF example: Flux as a quantised GGUF file, its blocks kept quantised under a 6 GB budget (not one of
#: :data:`FAMILIES`: ComfyUI's stock loaders cannot read it, so ``test_gguf_example.py`` compares it with the fp16
#: model's image instead).
FLUX_GGUF_EXAMPLE = Family(
    "11_flux_gguf_q8_budget",
    "11 Flux dev GGUF Q8 under a VRAM budget",
    FLUX_GGUF,
    "auto",
    "6GB",
    (SD15_CLIP_L,),
    "sd3",
    _vae("vae_16ch"),
    _SD3_LATENT,
    ("euler", "simple"),
    "Flux.1 dev as a GGUF file, no login needed: flux1-dev-Q8_0 (12.7 GB to download; Q4_K_S, Q5_K_S ... load the "
    "same way) in models/diffusion_models or models/unet; clip_l and t5xxl in models/text_encoders (type flux), on "
    "the CPU; ae.safetensors in models/vae. The "
    "weights stay quantised: the 6 GB budget counts their quantised bytes, the rest streams as blocks, and each layer "
    "is dequantised where it computes.",
    Released("flux1-dev-Q8_0.gguf", _FLUX_TE, "flux", "ae.safetensors", (1024, 1024), 20, 1.0),
    guidance=True,
)
