"""The example workflows' graphs, a few lines each: which nodes, their widget values in the frontend's order, the
links between them and where each goes on the canvas (``tools/templates/make_workflows.py`` lays them out against a
running ComfyUI and writes the files). Each is written on the test fixtures and released with the files users
download (``tools.templates.release``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

from tools.fixtures.make import SD15_CHECKPOINT, SD15_CHECKPOINT_B, SD15_CLIP_L, SD15_LORA, SD15_UNET, SD15_VAE
from tools.runtime.server import EXAMPLE_IMAGE
from tools.templates.families import FAMILIES, FLUX_GGUF_EXAMPLE, Family
from tools.templates.models import SD15_CONTROLNET, UPSCALER

PROMPT = "a lighthouse on a cliff at sunset, oil painting"


@dataclass
class Node:
    """One node: its type, widget values in the frontend's order, and links into its inputs."""

    id: int
    type: str
    widgets: list[Any] = field(default_factory=list)
    links: dict[str, tuple[int, int]] = field(default_factory=dict)  # input name -> (node id, output slot)
    pos: tuple[int, int] = (0, 0)
    title: str | None = None


def report(node_id: int, label: str, value: tuple[int, int], pos: tuple[int, int]) -> Node:
    """A VRAM Report on a wire."""
    return Node(
        node_id, "DeviceControl_VRAMReport", [label, "all", False], {"value": value}, pos, f"VRAM Report: {label}"
    )


def sampling(first: int, clip: tuple[int, int], model: tuple[int, int], x: int) -> list[Node]:
    """Prompt, negative prompt, a 64x64 latent and a 1-step KSampler (ids first .. first+3)."""
    return [
        Node(first, "CLIPTextEncode", [PROMPT], {"clip": clip}, (x, 80)),
        Node(first + 1, "CLIPTextEncode", ["blurry"], {"clip": clip}, (x, 300)),
        Node(first + 2, "EmptyLatentImage", [64, 64, 1], {}, (x, 480)),
        Node(
            first + 3,
            "KSampler",
            [42, "fixed", 1, 1, "euler", "normal", 1],
            {"model": model, "positive": (first, 0), "negative": (first + 1, 0), "latent_image": (first + 2, 0)},
            (x + 360, 80),
        ),
    ]


def loader(node_id: int, checkpoint: str, pos: tuple[int, int]) -> Node:
    """Load Checkpoint With Device, everything in RAM (the moves come later in the graph)."""
    return Node(
        node_id, "DeviceControl_LoadCheckpoint", [checkpoint, "cpu", "cpu", "cpu", "auto", "auto", "auto"], {}, pos
    )


def move_and_offload() -> list[Node]:
    """The basic scenario: load to RAM, Move To GPU, sample, Offload To CPU before decoding."""
    return [
        loader(1, SD15_CHECKPOINT, (20, 80)),
        report(2, "after loading to RAM", (1, 0), (20, 640)),
        Node(3, "DeviceControl_MoveToGPU", ["gpu:0", "all", False], {"model": (2, 0)}, (460, 80)),
        report(4, "after Move To GPU", (3, 0), (460, 640)),
        *sampling(5, (1, 1), (4, 0), 840),
        Node(9, "DeviceControl_OffloadToCPU", ["full", "2GB", True], {"model": (3, 0), "trigger": (8, 0)}, (1580, 80)),
        report(10, "after Offload To CPU", (9, 0), (1580, 640)),
        Node(11, "VAEDecode", [], {"samples": (10, 0), "vae": (1, 2)}, (1960, 80)),
        report(12, "after decoding", (11, 0), (1960, 640)),
        Node(13, "SaveImage", ["01_start_here_sd15_move_to_gpu_and_offload"], {"images": (12, 0)}, (2300, 80)),
    ]


def low_vram_lora() -> list[Node]:
    """A budget smaller than the UNet, with a LoRA: half streams, and the LoRA applies to both halves."""
    return [
        loader(1, SD15_CHECKPOINT, (20, 80)),
        Node(2, "LoraLoader", [SD15_LORA, 1, 1], {"model": (1, 0), "clip": (1, 1)}, (460, 80)),
        Node(3, "DeviceControl_MoveToGPU", ["gpu:0", "1.5GB", False], {"model": (2, 0)}, (840, 80)),
        report(4, "UNet on a 1.5 GB budget", (3, 0), (840, 640)),
        *sampling(5, (2, 1), (4, 0), 1220),
        Node(9, "VAEDecode", [], {"samples": (8, 0), "vae": (1, 2)}, (1960, 80)),
        report(10, "after decoding", (9, 0), (1960, 640)),
        Node(11, "SaveImage", ["04_sd15_low_vram_lora_budget"], {"images": (10, 0)}, (2300, 80)),
    ]


def controlnet_under_budget() -> list[Node]:
    """SD1.5 with a canny ControlNet, for a 6 GB card: the UNet on the GPU whole, the ControlNet beside it under a
    budget (the rest of it streams at each step), the edges of ComfyUI's example image guiding the picture."""
    return [
        loader(1, SD15_CHECKPOINT, (20, 80)),
        Node(2, "DeviceControl_MoveToGPU", ["gpu:0", "all", False], {"model": (1, 0)}, (460, 80)),
        report(3, "UNet on the GPU", (2, 0), (460, 420)),
        Node(4, "ControlNetLoader", [SD15_CONTROLNET], {}, (20, 900)),
        Node(5, "DeviceControl_MoveToGPU", ["gpu:0", "400MB", False], {"model": (4, 0)}, (460, 900)),
        report(6, "ControlNet on a 400 MB budget", (5, 0), (460, 1240)),
        Node(7, "LoadImage", [EXAMPLE_IMAGE, "image"], {}, (20, 1200)),
        Node(8, "Canny", [0.4, 0.8], {"image": (7, 0)}, (460, 1700)),
        *sampling(9, (1, 1), (3, 0), 1000)[:3],
        Node(
            12,
            "ControlNetApplyAdvanced",
            [1.0, 0.0, 1.0],
            {"positive": (9, 0), "negative": (10, 0), "control_net": (6, 0), "image": (8, 0)},
            (1000, 900),
        ),
        Node(
            13,
            "KSampler",
            [42, "fixed", 1, 1, "euler", "normal", 1],
            {"model": (3, 0), "positive": (12, 0), "negative": (12, 1), "latent_image": (11, 0)},
            (1400, 80),
        ),
        report(14, "after sampling", (13, 0), (1400, 640)),
        Node(15, "VAEDecode", [], {"samples": (14, 0), "vae": (1, 2)}, (1960, 80)),
        Node(16, "SaveImage", ["16_sd15_canny_controlnet_under_a_budget"], {"images": (15, 0)}, (2300, 80)),
    ]


def upscale_after_offload() -> list[Node]:
    """SD1.5 sampled on the GPU, its UNet offloaded once the latent is made, the image decoded and then upscaled 4x
    with the upscale model on the GPU the UNet left."""
    return [
        loader(1, SD15_CHECKPOINT, (20, 80)),
        Node(2, "DeviceControl_MoveToGPU", ["gpu:0", "all", False], {"model": (1, 0)}, (460, 80)),
        report(3, "UNet on the GPU", (2, 0), (460, 420)),
        *sampling(4, (1, 1), (3, 0), 840),
        Node(8, "DeviceControl_OffloadToCPU", ["full", "2GB", True], {"model": (2, 0), "trigger": (7, 0)}, (1580, 80)),
        report(9, "after Offload To CPU", (8, 0), (1580, 420)),
        Node(10, "VAEDecode", [], {"samples": (9, 0), "vae": (1, 2)}, (1960, 80)),
        Node(11, "UpscaleModelLoader", [UPSCALER], {}, (1960, 300)),
        Node(12, "DeviceControl_UpscaleImage", ["gpu:0"], {"upscale_model": (11, 0), "image": (10, 0)}, (2300, 80)),
        report(13, "after upscaling", (12, 0), (2300, 420)),
        Node(14, "SaveImage", ["17_sd15_upscaled_on_the_gpu_after_offload"], {"images": (13, 0)}, (2700, 80)),
    ]


#: Wan 2.2's two experts as released (ComfyUI's own loader reads their scaled fp8), and its note.
WAN22_EXPERTS = tuple(f"wan2.2_t2v_{noise}_noise_14B_fp8_scaled.safetensors" for noise in ("high", "low"))
WAN22_NOTE = (
    "Wan 2.2 text-to-video (A14B) in separate files, 33 frames at 832x480 saved as images, no login needed: "
    "wan2.2_t2v_high_noise_14B_fp8_scaled and wan2.2_t2v_low_noise_14B_fp8_scaled (about 14.3 GB each to download; "
    "13.3 GiB each in memory) in models/diffusion_models, read by ComfyUI's Load Diffusion Model; umt5_xxl in "
    "models/text_encoders (type wan), on the CPU; wan_2.1_vae (0.25 GB to download) in models/vae. The high-noise "
    "expert computes the first 10 of 20 steps on gpu:0 under a 9 GB budget, Offload To CPU gives its VRAM back, and "
    "the low-noise expert moves in for the other 10: one card holds one expert at a time."
)


def wan22_two_experts() -> list[Node]:
    """Wan 2.2's two diffusion models on one card in turn: the high-noise expert samples the first half of the
    steps, is offloaded, and the low-noise expert moves in for the second half."""
    high, low = WAN22_EXPERTS
    return [
        Node(1, "UNETLoader", [high, "default"], {}, (20, 80)),
        Node(2, "DeviceControl_MoveToGPU", ["gpu:0", "9GB", False], {"model": (1, 0)}, (460, 80)),
        report(3, "high-noise expert on the GPU", (2, 0), (460, 420)),
        Node(
            4,
            "DeviceControl_LoadTextEncoders",
            ["umt5_xxl_fp8_e4m3fn_scaled.safetensors", "none", "none", "none", "wan", "cpu", "auto"],
            {},
            (20, 420),
        ),
        Node(5, "CLIPTextEncode", [PROMPT], {"clip": (4, 0)}, (840, 80)),
        Node(6, "CLIPTextEncode", ["blurry"], {"clip": (4, 0)}, (840, 300)),
        Node(7, "EmptyHunyuanLatentVideo", [832, 480, 33, 1], {}, (840, 520)),
        Node(
            8,
            "KSamplerAdvanced",
            ["enable", 42, "fixed", 20, 3.5, "euler", "simple", 0, 10, "enable"],
            {"model": (3, 0), "positive": (5, 0), "negative": (6, 0), "latent_image": (7, 0)},
            (1220, 80),
        ),
        Node(9, "DeviceControl_OffloadToCPU", ["full", "2GB", True], {"model": (2, 0), "trigger": (8, 0)}, (1600, 80)),
        Node(10, "UNETLoader", [low, "default"], {}, (1600, 420)),
        Node(11, "DeviceControl_MoveToGPU", ["gpu:0", "9GB", False], {"model": (10, 0), "trigger": (9, 0)}, (1980, 80)),
        report(12, "low-noise expert on the GPU", (11, 0), (1980, 420)),
        Node(
            13,
            "KSamplerAdvanced",
            ["disable", 42, "fixed", 20, 3.5, "euler", "simple", 10, 10000, "disable"],
            {"model": (12, 0), "positive": (5, 0), "negative": (6, 0), "latent_image": (11, 1)},
            (2360, 80),
        ),
        Node(14, "DeviceControl_LoadVAE", ["wan_2.1_vae.safetensors", "gpu:0", "auto"], {}, (2360, 520)),
        Node(15, "VAEDecode", [], {"samples": (13, 0), "vae": (14, 0)}, (2740, 80)),
        Node(16, "SaveImage", ["18_wan22_two_experts_offload_between"], {"images": (15, 0)}, (3080, 80)),
        Node(17, "Note", [WAN22_NOTE], {}, (460, 760), title="About this workflow"),
    ]


#: Flux Redux's two files as released, and the example's note.
SIGLIP = "sigclip_vision_patch14_384.safetensors"
REDUX = "flux1-redux-dev.safetensors"
REDUX_NOTE = (
    "Flux Redux: the picture follows the image loaded (here ComfyUI's example), steered by the prompt. "
    "sigclip_vision_patch14_384 (0.86 GB to download, no login needed) in models/clip_vision, read by Load CLIP "
    "Vision With Device onto gpu:0, where it encodes the image; Offload To CPU then gives its VRAM back before Flux "
    "moves in. flux1-redux-dev (0.13 GB to download; log in to Hugging Face and accept the licence on its page "
    "first) in models/style_models. Flux.1 dev as in the Flux example: flux1-dev in models/diffusion_models (fp8 in "
    "RAM, moved to gpu:0 under a 9 GB budget), clip_l and t5xxl_fp8_e4m3fn in models/text_encoders (type flux), on "
    "the CPU, ae in models/vae. Lower the Redux strength for more of the prompt."
)


def flux_redux() -> list[Node]:
    """Flux Redux on a 12 GB card: SigLIP encodes the image on the GPU and is offloaded before Flux moves in under
    a budget; Redux turns the encoding into tokens beside the prompt's."""
    flux = next(family for family in FAMILIES if family.stem.startswith("10_flux")).released
    return [
        Node(1, "DeviceControl_LoadCLIPVision", [SIGLIP, "gpu:0", "all", "auto"], {}, (20, 80)),
        Node(2, "LoadImage", [EXAMPLE_IMAGE, "image"], {}, (20, 760)),
        Node(3, "CLIPVisionEncode", ["center"], {"clip_vision": (1, 0), "image": (2, 0)}, (460, 80)),
        Node(4, "DeviceControl_OffloadToCPU", ["full", "2GB", True], {"model": (1, 0), "trigger": (3, 0)}, (460, 300)),
        Node(5, "DeviceControl_LoadDiffusionModel", [flux.unet, "cpu", "fp8_e4m3fn"], {}, (20, 420)),
        Node(6, "DeviceControl_MoveToGPU", ["gpu:0", "9GB", False], {"model": (5, 0), "trigger": (4, 0)}, (840, 80)),
        report(7, "Flux on gpu:0, 9GB budget", (6, 0), (840, 420)),
        Node(
            8,
            "DeviceControl_LoadTextEncoders",
            [*flux.text_encoders, "none", "none", "flux", "cpu", "auto"],
            {},
            (460, 900),
        ),
        Node(9, "CLIPTextEncode", [PROMPT], {"clip": (8, 0)}, (1220, 80)),
        Node(10, "CLIPTextEncode", ["blurry"], {"clip": (8, 0)}, (1220, 300)),
        Node(11, "FluxGuidance", [3.5], {"conditioning": (9, 0)}, (1220, 520)),
        Node(12, "StyleModelLoader", [REDUX], {}, (1220, 720)),
        Node(
            13,
            "StyleModelApply",
            [1.0, "multiply"],
            {"conditioning": (11, 0), "style_model": (12, 0), "clip_vision_output": (3, 0)},
            (1600, 520),
        ),
        Node(14, "EmptySD3LatentImage", [*flux.size, 1], {}, (1600, 780)),
        Node(
            15,
            "KSampler",
            [42, "fixed", flux.steps, flux.cfg, "euler", "simple", 1],
            {"model": (7, 0), "positive": (13, 0), "negative": (10, 0), "latent_image": (14, 0)},
            (1980, 80),
        ),
        Node(16, "DeviceControl_LoadVAE", [flux.vae, "gpu:0", "auto"], {}, (1980, 620)),
        Node(17, "VAEDecode", [], {"samples": (15, 0), "vae": (16, 0)}, (2360, 80)),
        Node(18, "SaveImage", ["19_flux_redux_image_encoded_then_offloaded"], {"images": (17, 0)}, (2700, 80)),
        Node(19, "Note", [REDUX_NOTE], {}, (840, 760), title="About this workflow"),
    ]


def two_checkpoints() -> list[Node]:
    """Two checkpoints in one graph: the first is offloaded before the second moves in and refines its image."""
    return [
        loader(1, SD15_CHECKPOINT, (20, 80)),
        Node(2, "DeviceControl_MoveToGPU", ["gpu:0", "all", False], {"model": (1, 0)}, (460, 80)),
        report(3, "first model on the GPU", (2, 0), (460, 640)),
        *sampling(4, (1, 1), (3, 0), 840),
        Node(8, "DeviceControl_OffloadToCPU", ["full", "2GB", True], {"model": (2, 0), "trigger": (7, 0)}, (1580, 80)),
        loader(9, SD15_CHECKPOINT_B, (20, 1100)),
        Node(10, "DeviceControl_MoveToGPU", ["gpu:0", "all", False], {"model": (9, 0), "trigger": (8, 0)}, (460, 1100)),
        report(11, "second model on the GPU", (10, 0), (460, 1500)),
        Node(12, "CLIPTextEncode", [PROMPT], {"clip": (9, 1)}, (840, 1100)),
        Node(13, "CLIPTextEncode", ["blurry"], {"clip": (9, 1)}, (840, 1320)),
        Node(
            14,
            "KSampler",
            [7, "fixed", 1, 1, "euler", "normal", 0.6],
            {"model": (11, 0), "positive": (12, 0), "negative": (13, 0), "latent_image": (10, 1)},
            (1220, 1100),
        ),
        Node(15, "VAEDecode", [], {"samples": (14, 0), "vae": (9, 2)}, (1600, 1100)),
        Node(16, "SaveImage", ["07_two_checkpoints_offload_between"], {"images": (15, 0)}, (1960, 1100)),
    ]


def split_across_gpus() -> list[Node]:
    """Flux's diffusion model over two GPUs in pipeline mode (on a machine without them, it stays in RAM, warned);
    its text encoder in RAM, the VAE on ``gpu:0``."""
    flux = next(family for family in FAMILIES if "_flux_" in f"_{family.stem}")
    files = flux.released
    return [
        Node(1, "DeviceControl_LoadDiffusionModel", [files.unet, "cpu", flux.dtype], {}, (20, 80)),
        Node(2, "DeviceControl_SplitModel", ["gpu:0=50%, gpu:1=*", "pipeline"], {"model": (1, 0)}, (20, 420)),
        report(3, "split over two GPUs", (2, 0), (20, 720)),
        Node(
            4,
            "DeviceControl_LoadTextEncoders",
            [*files.text_encoders, "none", "none", files.clip_type, "cpu", "auto"],
            {},
            (460, 80),
        ),
        Node(5, "CLIPTextEncode", [PROMPT], {"clip": (4, 0)}, (840, 80)),
        Node(6, "CLIPTextEncode", ["blurry"], {"clip": (4, 0)}, (840, 300)),
        Node(7, "FluxGuidance", [3.5], {"conditioning": (5, 0)}, (840, 720)),
        Node(8, flux.latent[0], [*files.size, 1], {}, (840, 520)),
        Node(
            9,
            "KSampler",
            [42, "fixed", files.steps, files.cfg, *flux.sampler, 1],
            {"model": (3, 0), "positive": (7, 0), "negative": (6, 0), "latent_image": (8, 0)},
            (1220, 80),
        ),
        report(10, "after sampling", (9, 0), (1220, 720)),
        Node(11, "DeviceControl_LoadVAE", [files.vae, "gpu:0", "auto"], {}, (1220, 520)),
        Node(12, "VAEDecode", [], {"samples": (10, 0), "vae": (11, 0)}, (1600, 80)),
        Node(13, "SaveImage", ["12_flux_split_across_two_gpus"], {"images": (12, 0)}, (1960, 80)),
        Node(
            14,
            "Note",
            [
                "Flux.1 dev over two GPUs: flux1-dev (11.1 GiB in fp8) in models/diffusion_models is split half and "
                "half over gpu:0 and gpu:1 (two 8 GB cards), each half computing where it lives; clip_l and t5xxl in "
                "models/text_encoders (type flux), on the CPU; ae.safetensors in models/vae. On one GPU and RAM, "
                "write 'gpu:0=6GB, cpu=*' and choose stream."
            ],
            {},
            (460, 420),
            title="About this workflow",
        ),
    ]


def split_files() -> list[Node]:
    """A model shipped as separate files: the diffusion model loaded straight onto the GPU by our loader, the
    text encoder and the VAE by ComfyUI's own loaders, in RAM."""
    return [
        Node(1, "DeviceControl_LoadDiffusionModel", [SD15_UNET, "gpu:0", "auto"], {}, (20, 80)),
        report(2, "diffusion model loaded on the GPU", (1, 0), (20, 640)),
        Node(3, "CLIPLoader", [SD15_CLIP_L, "stable_diffusion", "default"], {}, (460, 80)),
        *sampling(4, (3, 0), (2, 0), 840),
        Node(8, "VAELoader", [SD15_VAE], {}, (1220, 480)),
        Node(9, "VAEDecode", [], {"samples": (7, 0), "vae": (8, 0)}, (1580, 80)),
        report(10, "after decoding", (9, 0), (1580, 640)),
        Node(11, "SaveImage", ["08_sd15_split_files_diffusion_model_on_gpu"], {"images": (10, 0)}, (1960, 80)),
    ]


def family_split_files(family: Family) -> list[Node]:
    """A family shipped as separate files, placed for a 12 GB card (see ``tools.templates.families``)."""
    released = family.released
    files = [*released.text_encoders, *["none"] * (4 - len(released.text_encoders))]
    latent_type = family.latent[0]
    positive = (7, 0) if family.guidance else (5, 0)
    nodes = [
        Node(1, "DeviceControl_LoadDiffusionModel", [released.unet, "cpu", family.dtype], {}, (20, 80)),
        Node(2, "DeviceControl_MoveToGPU", ["gpu:0", family.budget, False], {"model": (1, 0)}, (20, 420)),
        report(3, f"diffusion model on gpu:0, {family.budget} budget", (2, 0), (20, 720)),
        Node(4, "DeviceControl_LoadTextEncoders", [*files, released.clip_type, "cpu", "auto"], {}, (460, 80)),
        Node(5, "CLIPTextEncode", [PROMPT], {"clip": (4, 0)}, (840, 80)),
        Node(6, "CLIPTextEncode", ["blurry"], {"clip": (4, 0)}, (840, 300)),
        Node(8, latent_type, [*released.size, 1], {}, (840, 520)),
        Node(
            9,
            "KSampler",
            [42, "fixed", released.steps, released.cfg, *family.sampler, 1],
            {"model": (3, 0), "positive": positive, "negative": (6, 0), "latent_image": (8, 0)},
            (1220, 80),
        ),
        Node(10, "DeviceControl_LoadVAE", [released.vae, "gpu:0", "auto"], {}, (1220, 520)),
        Node(11, "VAEDecode", [], {"samples": (9, 0), "vae": (10, 0)}, (1600, 80)),
        report(12, "after decoding", (11, 0), (1600, 420)),
        Node(13, "SaveImage", [family.stem], {"images": (12, 0)}, (1960, 80)),
        Node(14, "Note", [family.note], {}, (460, 720), title="About this workflow"),
    ]
    if family.guidance:
        nodes.append(Node(7, "FluxGuidance", [3.5], {"conditioning": (5, 0)}, (840, 720)))
    return nodes


WORKFLOWS = {
    "01 Start here - SD1.5 moved to the GPU, then offloaded.json": move_and_offload,
    "08 SD1.5 from separate files - diffusion model on the GPU.json": split_files,
    "04 SD1.5 and a LoRA under a 1.5 GB VRAM budget.json": low_vram_lora,
    "07 Two checkpoints - the first offloaded before the second.json": two_checkpoints,
    "16 SD1.5 with a canny ControlNet under a VRAM budget.json": controlnet_under_budget,
    "17 SD1.5 upscaled on the GPU after the UNet was offloaded.json": upscale_after_offload,
    "18 Wan 2.2 - two experts on one card, offloaded in turn.json": wan22_two_experts,
    "19 Flux Redux - the image encoded on the GPU, then offloaded.json": flux_redux,
    "12 Flux dev split across two GPUs.json": split_across_gpus,
    **{f"{family.title}.json": partial(family_split_files, family) for family in FAMILIES},
    f"{FLUX_GGUF_EXAMPLE.title}.json": partial(family_split_files, FLUX_GGUF_EXAMPLE),
}
