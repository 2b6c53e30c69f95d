"""The families table: every diffusion-model family ComfyUI 0.3.75 builds, in its matching order.

Each row names the ``comfy.supported_models`` class, what users call the family, the architecture branch
(see ``core.families``), the hyper-parameters that must match, the prediction type, where the VAE sits in a
full checkpoint, and the dtypes ComfyUI computes it in. The first row that matches wins: the order matters
where one family's hyper-parameters are a subset of another's (SD 1.5 instruct-pix2pix before SD 1.5).
"""

from __future__ import annotations

from typing import Any

from .families import Branch, Family, Fields
from .keyview import KeyView

# -- prediction types that depend on the file --------------------------------------------------------------


def _sdxl_type(view: KeyView) -> str:
    """SDXL-family checkpoints mark non-default prediction with top-level keys."""
    if view.root_has("edm_mean") and view.root_has("edm_std"):
        return "EDM"
    if view.root_has("edm_vpred.sigma_max"):
        return "V_PREDICTION_EDM"
    return "V_PREDICTION" if view.root_has("v_pred") else "EPS"


SD2_UNDECIDED = "EPS or V_PREDICTION (ComfyUI decides from weight values)"


def _sd2_type(view: KeyView) -> str:
    """SD2 eps and v files share every key and shape; only a marker saved by some tools tells them apart."""
    if view.shape("input_blocks.0.0.weight")[1] != 4:
        return "EPS"
    return "V_PREDICTION" if view.root_has("v_pred") else SD2_UNDECIDED


# -- the families, in ComfyUI's matching order -------------------------------------------------------------

_SD1 = {"context_dim": 768, "model_channels": 320, "use_linear_in_transformer": False, "adm_in_channels": None}
_SD1 |= {"use_temporal_attention": False}
_SD2 = {"context_dim": 1024, "model_channels": 320, "use_linear_in_transformer": True, "adm_in_channels": None}
_SD2 |= {"use_temporal_attention": False}
_SDXL = {"model_channels": 320, "use_linear_in_transformer": True, "context_dim": 2048, "adm_in_channels": 2816}
_SDXL |= {"use_temporal_attention": False}
_SVD = {"model_channels": 320, "in_channels": 8, "use_linear_in_transformer": True, "context_dim": 1024}
_SVD |= {"transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0], "use_temporal_attention": True, "use_temporal_resblock": True}
_BF16 = ("bf16", "fp32")
_DIT = {"vae_prefix": "vae."}


def _wan_family(cls: str, name: str, **match: Any) -> Family:
    return Family(cls, name, "wan", {"image_model": "wan2.1", **match}, model_type="FLOW", **_DIT)


FAMILIES: tuple[Family, ...] = (
    Family(
        "LotusD",
        "Lotus depth",
        "unet",
        {
            "model_channels": 320,
            "use_linear_in_transformer": True,
            "use_temporal_attention": False,
            "adm_in_channels": 4,
            "in_channels": 4,
        },
        model_type="IMG_TO_IMG",
    ),
    Family(
        "Stable_Zero123",
        "Stable Zero123",
        "unet",
        {**_SD1, "in_channels": 8},
        required_keys=("cc_projection.weight", "cc_projection.bias"),
    ),
    Family("SD15_instructpix2pix", "Stable Diffusion 1.5 instruct-pix2pix", "unet", {**_SD1, "in_channels": 8}),
    Family("SD15", "Stable Diffusion 1.5", "unet", _SD1),
    Family("SD20", "Stable Diffusion 2.x", "unet", _SD2, model_type=_sd2_type),
    Family(
        "SD21UnclipL", "Stable Diffusion 2.1 unCLIP-L", "unet", {**_SD2, "adm_in_channels": 1536}, model_type=_sd2_type
    ),
    Family(
        "SD21UnclipH", "Stable Diffusion 2.1 unCLIP-H", "unet", {**_SD2, "adm_in_channels": 2048}, model_type=_sd2_type
    ),
    Family(
        "SDXL_instructpix2pix",
        "SDXL instruct-pix2pix",
        "unet",
        {**_SDXL, "transformer_depth": [0, 0, 2, 2, 10, 10], "in_channels": 8},
        model_type=_sdxl_type,
    ),
    Family(
        "SDXLRefiner",
        "SDXL Refiner",
        "unet",
        {
            "model_channels": 384,
            "use_linear_in_transformer": True,
            "context_dim": 1280,
            "adm_in_channels": 2560,
            "transformer_depth": [0, 0, 4, 4, 4, 4, 0, 0],
            "use_temporal_attention": False,
        },
    ),
    Family("SDXL", "SDXL", "unet", {**_SDXL, "transformer_depth": [0, 0, 2, 2, 10, 10]}, model_type=_sdxl_type),
    Family("SSD1B", "SSD-1B", "unet", {**_SDXL, "transformer_depth": [0, 0, 2, 2, 4, 4]}, model_type=_sdxl_type),
    Family("KOALA_700M", "KOALA 700M", "unet", {**_SDXL, "transformer_depth": [0, 2, 5]}, model_type=_sdxl_type),
    Family("KOALA_1B", "KOALA 1B", "unet", {**_SDXL, "transformer_depth": [0, 2, 6]}, model_type=_sdxl_type),
    Family(
        "Segmind_Vega",
        "Segmind Vega",
        "unet",
        {**_SDXL, "transformer_depth": [0, 0, 1, 1, 2, 2]},
        model_type=_sdxl_type,
    ),
    Family(
        "SD_X4Upscaler",
        "Stable Diffusion x4 upscaler",
        "unet",
        {**_SD2, "model_channels": 256, "in_channels": 7},
        model_type="V_PREDICTION",
    ),
    Family(
        "Stable_Cascade_C",
        "Stable Cascade stage C",
        "stable_cascade",
        {"stable_cascade_stage": "c"},
        model_type="STABLE_CASCADE",
        vae_prefix="vae.",
        dtypes=_BF16,
    ),
    Family(
        "Stable_Cascade_B",
        "Stable Cascade stage B",
        "stable_cascade",
        {"stable_cascade_stage": "b"},
        model_type="STABLE_CASCADE",
        vae_prefix="vae.",
    ),
    Family(
        "SV3D_u",
        "SV3D-u",
        "unet",
        {**_SVD, "adm_in_channels": 256},
        model_type="V_PREDICTION_EDM",
        vae_prefix="conditioner.embedders.1.encoder.",
    ),
    Family(
        "SV3D_p",
        "SV3D-p",
        "unet",
        {**_SVD, "adm_in_channels": 1280},
        model_type="V_PREDICTION_EDM",
        vae_prefix="conditioner.embedders.1.encoder.",
    ),
    Family(
        "SD3",
        "Stable Diffusion 3 / 3.5",
        "mmdit",
        {"in_channels": 16, "pos_embed_scaling_factor": None},
        model_type="FLOW",
    ),
    Family(
        "StableAudio",
        "Stable Audio",
        "stable_audio",
        {"audio_model": "dit1.0"},
        model_type="V_PREDICTION_CONTINUOUS",
        vae_prefix="pretransform.model.",
    ),
    Family("AuraFlow", "AuraFlow", "auraflow", {"cond_seq_dim": 2048}, model_type="FLOW", **_DIT),
    Family("PixArtAlpha", "PixArt-Alpha", "pixart", {"image_model": "pixart_alpha"}, **_DIT),
    Family("PixArtSigma", "PixArt-Sigma", "pixart", {"image_model": "pixart_sigma"}, **_DIT),
    Family("HunyuanDiT", "Hunyuan-DiT", "hunyuan_dit", {"image_model": "hydit"}, model_type="V_PREDICTION", **_DIT),
    Family(
        "HunyuanDiT1",
        "Hunyuan-DiT 1.0/1.1",
        "hunyuan_dit",
        {"image_model": "hydit1"},
        model_type="V_PREDICTION",
        **_DIT,
    ),
    Family(
        "FluxInpaint",
        "Flux.1 Fill",
        "flux",
        {"image_model": "flux", "guidance_embed": True, "in_channels": 96},
        model_type="FLUX",
        dtypes=_BF16,
        **_DIT,
    ),
    Family(
        "Flux",
        "Flux.1 dev",
        "flux",
        {"image_model": "flux", "guidance_embed": True},
        model_type="FLUX",
        dtypes=("bf16", "fp16", "fp32"),
        **_DIT,
    ),
    Family(
        "FluxSchnell",
        "Flux.1 schnell",
        "flux",
        {"image_model": "flux", "guidance_embed": False},
        model_type="FLOW",
        dtypes=("bf16", "fp16", "fp32"),
        **_DIT,
    ),
    Family("GenmoMochi", "Mochi", "mochi", {"image_model": "mochi_preview"}, model_type="FLOW", dtypes=_BF16, **_DIT),
    Family("LTXV", "LTX-Video", "ltxv", {"image_model": "ltxv"}, model_type="FLUX", dtypes=_BF16, **_DIT),
    Family(
        "HunyuanVideo15_SR_Distilled",
        "HunyuanVideo 1.5 super-resolution",
        "hunyuan_video",
        {"image_model": "hunyuan_video", "vision_in_dim": 1152, "in_channels": 98},
        model_type="FLOW",
        **_DIT,
    ),
    Family(
        "HunyuanVideo15",
        "HunyuanVideo 1.5",
        "hunyuan_video",
        {"image_model": "hunyuan_video", "vision_in_dim": 1152},
        model_type="FLOW",
        **_DIT,
    ),
    Family(
        "HunyuanImage21Refiner",
        "HunyuanImage 2.1 refiner",
        "hunyuan_video",
        {"image_model": "hunyuan_video", "patch_size": [1, 1, 1], "vec_in_dim": None},
        model_type="FLOW",
        dtypes=_BF16,
        **_DIT,
    ),
    Family(
        "HunyuanImage21",
        "HunyuanImage 2.1",
        "hunyuan_video",
        {"image_model": "hunyuan_video", "vec_in_dim": None},
        model_type="FLOW",
        dtypes=_BF16,
        **_DIT,
    ),
    Family(
        "HunyuanVideoSkyreelsI2V",
        "HunyuanVideo SkyReels I2V",
        "hunyuan_video",
        {"image_model": "hunyuan_video", "in_channels": 32},
        model_type="FLOW",
        dtypes=_BF16,
        **_DIT,
    ),
    Family(
        "HunyuanVideoI2V",
        "HunyuanVideo I2V",
        "hunyuan_video",
        {"image_model": "hunyuan_video", "in_channels": 33},
        model_type="FLOW",
        dtypes=_BF16,
        **_DIT,
    ),
    Family(
        "HunyuanVideo",
        "HunyuanVideo",
        "hunyuan_video",
        {"image_model": "hunyuan_video"},
        model_type="FLOW",
        dtypes=_BF16,
        **_DIT,
    ),
    Family(
        "CosmosT2V",
        "Cosmos 1 text-to-video",
        "cosmos",
        {"image_model": "cosmos", "in_channels": 16},
        model_type="EDM",
        **_DIT,
    ),
    Family(
        "CosmosI2V",
        "Cosmos 1 image-to-video",
        "cosmos",
        {"image_model": "cosmos", "in_channels": 17},
        model_type="EDM",
        **_DIT,
    ),
    Family(
        "CosmosT2IPredict2",
        "Cosmos Predict2 text-to-image",
        "cosmos_predict2",
        {"image_model": "cosmos_predict2", "in_channels": 16},
        model_type="FLOW_COSMOS",
        dtypes=_BF16,
    ),
    Family(
        "CosmosI2VPredict2",
        "Cosmos Predict2 image-to-video",
        "cosmos_predict2",
        {"image_model": "cosmos_predict2", "in_channels": 17},
        model_type="FLOW_COSMOS",
        dtypes=_BF16,
    ),
    Family(
        "ZImage", "Z-Image", "lumina2", {"image_model": "lumina2", "dim": 3840}, model_type="FLOW", dtypes=_BF16, **_DIT
    ),
    Family(
        "Lumina2", "Lumina Image 2.0", "lumina2", {"image_model": "lumina2"}, model_type="FLOW", dtypes=_BF16, **_DIT
    ),
    _wan_family("WAN22_T2V", "Wan 2.2 TI2V 5B", model_type="t2v", out_dim=48),
    _wan_family("WAN21_T2V", "Wan 2.1/2.2 text-to-video", model_type="t2v"),
    _wan_family("WAN21_I2V", "Wan 2.1 image-to-video", model_type="i2v", in_dim=36),
    _wan_family("WAN21_FunControl2V", "Wan 2.1 Fun Control", model_type="i2v", in_dim=48),
    _wan_family("WAN21_Vace", "Wan 2.1 VACE", model_type="vace"),
    _wan_family("WAN21_Camera", "Wan 2.1 camera control", model_type="camera", in_dim=32),
    _wan_family("WAN22_Camera", "Wan 2.2 camera control", model_type="camera_2.2", in_dim=36),
    _wan_family("WAN22_S2V", "Wan 2.2 speech-to-video", model_type="s2v"),
    _wan_family("WAN21_HuMo", "Wan 2.1 HuMo", model_type="humo"),
    _wan_family("WAN22_Animate", "Wan 2.2 Animate", model_type="animate"),
    Family(
        "Hunyuan3Dv2mini",
        "Hunyuan3D 2 mini",
        "hunyuan3d2",
        {"image_model": "hunyuan3d2", "depth": 8},
        model_type="FLOW",
        vae_prefix="vae.",
    ),
    Family("Hunyuan3Dv2", "Hunyuan3D 2", "hunyuan3d2", {"image_model": "hunyuan3d2"}, model_type="FLOW", **_DIT),
    Family(
        "Hunyuan3Dv2_1", "Hunyuan3D 2.1", "hunyuan3d2_1", {"image_model": "hunyuan3d2_1"}, model_type="FLOW", **_DIT
    ),
    Family("HiDream", "HiDream-I1", "hidream", {"image_model": "hidream"}, model_type="FLOW", dtypes=_BF16, **_DIT),
    Family("Chroma", "Chroma", "flux", {"image_model": "chroma"}, model_type="FLUX", dtypes=("bf16", "fp16", "fp32")),
    Family("ChromaRadiance", "Chroma Radiance", "flux", {"image_model": "chroma_radiance"}, model_type="FLUX"),
    Family("ACEStep", "ACE-Step", "ace", {"audio_model": "ace"}, model_type="FLOW", dtypes=_BF16, **_DIT),
    Family("Omnigen2", "OmniGen2", "omnigen2", {"image_model": "omnigen2"}, model_type="FLOW", dtypes=_BF16, **_DIT),
    Family(
        "QwenImage", "Qwen-Image", "qwen_image", {"image_model": "qwen_image"}, model_type="FLUX", dtypes=_BF16, **_DIT
    ),
    Family(
        "Flux2", "Flux.2", "flux", {"image_model": "flux2"}, model_type="FLUX", dtypes=("bf16", "fp16", "fp32"), **_DIT
    ),
    Family(
        "SVD_img2vid", "Stable Video Diffusion", "unet", {**_SVD, "adm_in_channels": 768}, model_type="V_PREDICTION_EDM"
    ),
)


def match_family(branch: Branch, fields: Fields, view: KeyView) -> Family | None:
    """The first family of the table whose required fields and keys the file has."""
    return next((f for f in FAMILIES if f.branch == branch.name and not f.mismatches(fields, view)), None)
