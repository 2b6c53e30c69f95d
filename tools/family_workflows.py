"""The example workflows of the model families that ship as separate files: SDXL, SD3.5, Flux, Chroma and Wan 2.1.

Each is what a 12 GB card wants: the diffusion model read into RAM in the dtype that suits it, then moved to
``gpu:0`` under a budget by Move To GPU (what does not fit streams from RAM at each step); the text encoders on
the CPU; the VAE on ``gpu:0``, where it decodes. The files named are the synthetic ones the tests generate
(``tools/make_family_fixtures.py``), whose text conditioning comes from CLIP-L (and CLIP-G for SDXL) loaded as ComfyUI's
``sd3`` type (``sdxl`` for SDXL); a note in each workflow says which released files to pick instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from tools.gguf_files import FLUX_GGUF
from tools.make_family_fixtures import DIFFUSION_FIXTURES
from tools.make_family_parts import CLIP_G, VAES
from tools.make_fixtures import SD15_CLIP_L, SD15_VAE

NOTE_SIZE = (420, 220)


@dataclass(frozen=True)
class Family:
    """One family's example: its files, how its diffusion model is placed, and how it samples."""

    stem: str
    unet: str
    dtype: str
    budget: str
    text_encoders: tuple[str, ...]
    clip_type: str
    vae: str
    latent: tuple[str, list]
    sampler: tuple[str, str]
    note: str
    guidance: bool = False


def _vae(key: str) -> str:
    return next(part.file for part in VAES if part.key == key)


_CLIP_PAIR = (SD15_CLIP_L, CLIP_G.file)
_SD3_LATENT = ("EmptySD3LatentImage", [64, 64, 1])

FAMILIES = (
    Family(
        "sdxl_split_files_unet_on_gpu",
        DIFFUSION_FIXTURES["sdxl_unet"].file,
        "fp16",
        "8GB",
        _CLIP_PAIR,
        "sdxl",
        SD15_VAE,
        ("EmptyLatentImage", [64, 64, 1]),
        ("euler", "normal"),
        "SDXL in separate files. With the released files: the SDXL UNet (fp16, 4.8 GiB) in diffusion_models, "
        "clip_l and clip_g in text_encoders (type sdxl), the SDXL VAE in vae. The UNet fits an 8 GB budget whole.",
    ),
    Family(
        "sd35_split_files_fp8_budget",
        DIFFUSION_FIXTURES["sd35"].file,
        "fp8_e4m3fn",
        "7GB",
        (SD15_CLIP_L,),
        "sd3",
        _vae("vae_16ch"),
        _SD3_LATENT,
        ("euler", "simple"),
        "SD3.5 Large in separate files. With the released files: sd3.5_large (7.6 GiB in fp8) in "
        "diffusion_models; clip_l, clip_g and t5xxl in text_encoders as clip_name1-3 (type sd3), on the CPU; the SD3 "
        "VAE. A 7 GB budget keeps most of the model on the GPU and streams the rest each step.",
    ),
    Family(
        "flux_split_files_fp8_budget",
        DIFFUSION_FIXTURES["flux"].file,
        "fp8_e4m3fn",
        "9GB",
        (SD15_CLIP_L,),
        "sd3",
        _vae("vae_16ch"),
        _SD3_LATENT,
        ("euler", "simple"),
        "Flux.1 dev in separate files. With the released files: flux1-dev (11.1 GiB in fp8) in "
        "diffusion_models; clip_l and t5xxl as clip_name1-2 with type flux, on the CPU; ae.safetensors as the VAE. "
        "A 9 GB budget leaves room on a 12 GB card for the activations; the rest streams each step.",
        guidance=True,
    ),
    Family(
        "chroma_split_files_fp8_budget",
        DIFFUSION_FIXTURES["chroma"].file,
        "fp8_e4m3fn",
        "8GB",
        (SD15_CLIP_L,),
        "sd3",
        _vae("vae_16ch"),
        _SD3_LATENT,
        ("euler", "simple"),
        "Chroma in separate files. With the released files: the Chroma model (8.3 GiB in fp8) in "
        "diffusion_models; t5xxl as clip_name1 with type chroma, on the CPU; the Flux ae.safetensors as the VAE.",
    ),
    Family(
        "wan21_split_files_fp8_budget",
        DIFFUSION_FIXTURES["wan21"].file,
        "fp8_e4m3fn",
        "9GB",
        (SD15_CLIP_L,),
        "sd3",
        _vae("wan21_vae"),
        ("EmptyHunyuanLatentVideo", [64, 64, 5, 1]),
        ("euler", "simple"),
        "Wan 2.1 text-to-video in separate files (five frames here). With the released files: wan2.1_t2v_14B (13.3 GiB "
        "in fp8, more than the card holds) in diffusion_models; umt5_xxl as clip_name1 with type wan, on the CPU; "
        "wan_2.1_vae. A 9 GB budget keeps about two thirds of the model on the GPU and streams the rest each step.",
    ),
)

#: The GGUF example: Flux as a quantised GGUF file, its blocks kept quantised under a 6 GB budget (not one of
#: :data:`FAMILIES`: ComfyUI's stock loaders cannot read it, so ``test_gguf_example.py`` compares it with the fp16
#: model's image instead).
FLUX_GGUF_EXAMPLE = Family(
    "flux_gguf_q8_budget",
    FLUX_GGUF,
    "auto",
    "6GB",
    (SD15_CLIP_L,),
    "sd3",
    _vae("vae_16ch"),
    _SD3_LATENT,
    ("euler", "simple"),
    "Flux.1 dev as a GGUF file (Q8_0). With the released files: a flux1-dev GGUF (Q4_K_S, Q5_K_S, Q8_0 ...) in "
    "diffusion_models or unet; clip_l and t5xxl as safetensors (or the T5 as a GGUF) as "
    "clip_name1-2 with type flux, on the CPU; ae.safetensors as the VAE. The weights stay quantised: the 6 GB budget "
    "counts their quantised bytes, the rest streams as blocks, and each layer is dequantised where it computes.",
    guidance=True,
)
