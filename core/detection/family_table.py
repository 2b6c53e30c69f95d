"""The families table: every diffusion-model family ComfyUI builds (0.3.75, 0.28 and 0.33), in its matching order.

Each row names the ``comfy.supported_models`` class, what users call the family, the architecture branch
(see ``core.detection.branches``), the hyper-parameters that must match, the prediction type, where the VAE sits in a
full checkpoint, and the dtypes ComfyUI computes it in. The first row that matches wins: the order matters
where one family's hyper-parameters are a subset of another's (SD 1.5 instruct-pix2pix before SD 1.5).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .branches import Branch, Fields
from .keyview import KeyView


@dataclass(frozen=True)
class Family:
    """A family of diffusion models, as ComfyUI knows it.

    Args:
        comfy_class: the ``comfy.supported_models`` class name.
        name: what users call it.
        branch: the architecture branch it belongs to.
        match: hyper-parameters (from the branch's ``fields``) that must all be equal.
        required_keys: keys that must exist anywhere in the file (outside the diffusion-model prefix too).
        model_type: the prediction type, or a rule computing it from the file.
        vae_prefix: where the VAE sits in a full checkpoint (text encoders are found by their own rules).
        dtypes: dtypes ComfyUI computes this family in, preferred first.
    """

    comfy_class: str
    name: str
    branch: str
    match: Mapping[str, Any] = field(default_factory=dict)
    required_keys: tuple[str, ...] = ()
    model_type: str | Callable[[KeyView], str] = "EPS"
    vae_prefix: str = "first_stage_model."
    dtypes: tuple[str, ...] = ("fp16", "bf16", "fp32")

    def mismatches(self, fields: Fields, view: KeyView) -> list[str]:
        """Why this family does not match (empty when it does)."""
        reasons = [
            f"{name} is {fields.get(name, 'absent')!r}, {self.comfy_class} needs {wanted!r}"
            for name, wanted in self.match.items()
            if fields.get(name, _ABSENT) != wanted
        ]
        reasons += [f"key {key!r} is missing" for key in self.required_keys if not view.root_has(key)]
        return reasons

    def type_of(self, view: KeyView) -> str:
        """The model's prediction type (``EPS``, ``V_PREDICTION``, ``FLOW``, ...)."""
        return self.model_type(view) if callable(self.model_type) else self.model_type


_ABSENT = object()

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
_BF16_FIRST = ("bf16", "fp16", "fp32")
_ANY = ("fp16", "bf16", "fp32")
_DIT = {"vae_prefix": "vae."}


def _wan_family(cls: str, name: str, **match: Any) -> Family:
    return Family(cls, name, "wan", {"image_model": "wan2.1", **match}, model_type="FLOW", **_DIT)


def _dit(
    cls: str, name: str, branch: str, model: str = "", mt: str = "FLOW", dt: tuple = _BF16, **match: Any
) -> Family:
    """A transformer family: its class needs ``image_model`` ``model`` (else the branch's name) and ``match``.

    Computed in ``dt``; its VAE sits under ``vae.`` in a checkpoint unless ``match`` gives a ``vae_prefix``.
    """
    vae = match.pop("vae_prefix", "vae.")
    fields = {"image_model": model or branch, **match}
    return Family(cls, name, branch, fields, model_type=mt, vae_prefix=vae, dtypes=dt)


_OWN_VAE = {"vae_prefix": "first_stage_model."}  # classes that keep ComfyUI's default VAE prefix
_HV = ("hunyuan_video", "hunyuan_video")
_FLUX = ("flux", "flux")
_DDPM = "V_PREDICTION_DDPM"


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
        "StableAudio3",
        "Stable Audio 3",
        "stable_audio",
        {"audio_model": "dit1.0", "global_cond_shared_embed": True},
        model_type="FLOW",
        vae_prefix="pretransform.model.",
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
    _dit("HunyuanDiT1", "Hunyuan-DiT 1.0/1.1", "hunyuan_dit", "hydit1", "V_PREDICTION", _ANY),
    _dit("FluxInpaint", "Flux.1 Fill", *_FLUX, "FLUX", guidance_embed=True, in_channels=96),
    _dit("Flux", "Flux.1 dev", *_FLUX, "FLUX", _BF16_FIRST, guidance_embed=True),
    _dit(
        "LongCatImage",
        "LongCat-Image",
        *_FLUX,
        "FLUX",
        _BF16_FIRST,
        guidance_embed=False,
        vec_in_dim=None,
        context_in_dim=3584,
    ),
    _dit("FluxSchnell", "Flux.1 schnell", *_FLUX, "FLOW", _BF16_FIRST, guidance_embed=False),
    Family("GenmoMochi", "Mochi", "mochi", {"image_model": "mochi_preview"}, model_type="FLOW", dtypes=_BF16, **_DIT),
    Family("LTXV", "LTX-Video", "ltxv", {"image_model": "ltxv"}, model_type="FLUX", dtypes=_BF16, **_DIT),
    _dit("LTXAV", "LTX-2 (audio-video)", "ltxv", "ltxav", "FLUX"),
    _dit("MiniMaxH3", "MiniMax H3 (audio-video)", "minimax_h3", mt="FLOW_AV"),
    _dit(
        "HunyuanVideo15_SR_Distilled",
        "HunyuanVideo 1.5 super-resolution",
        *_HV,
        dt=_ANY,
        vision_in_dim=1152,
        in_channels=98,
    ),
    _dit("HunyuanVideo15", "HunyuanVideo 1.5", *_HV, dt=_ANY, vision_in_dim=1152),
    _dit("HunyuanImage21Refiner", "HunyuanImage 2.1 refiner", *_HV, patch_size=[1, 1, 1], vec_in_dim=None),
    _dit("HunyuanImage21", "HunyuanImage 2.1", *_HV, vec_in_dim=None),
    _dit("HunyuanVideoSkyreelsI2V", "HunyuanVideo SkyReels I2V", *_HV, in_channels=32),
    _dit("HunyuanVideoI2V", "HunyuanVideo I2V", *_HV, in_channels=33),
    _dit("HunyuanVideo", "HunyuanVideo", *_HV),
    _dit("CosmosT2V", "Cosmos 1 text-to-video", "cosmos", mt="EDM", dt=_ANY, in_channels=16),
    _dit("CosmosI2V", "Cosmos 1 image-to-video", "cosmos", mt="EDM", dt=_ANY, in_channels=17),
    _dit(
        "CosmosT2IPredict2",
        "Cosmos Predict2 text-to-image",
        "cosmos_predict2",
        mt="FLOW_COSMOS",
        in_channels=16,
        **_OWN_VAE,
    ),
    _dit(
        "CosmosI2VPredict2",
        "Cosmos Predict2 image-to-video",
        "cosmos_predict2",
        mt="FLOW_COSMOS",
        in_channels=17,
        **_OWN_VAE,
    ),
    _dit("ZImagePixelSpace", "Z-Image (pixel space)", "lumina2", "zimage_pixel"),
    _dit("ZImage", "Z-Image", "lumina2", dim=3840),
    _dit("PiD", "PiD (pixel diffusion decoder)", "pid"),
    _dit("PixelDiTT2I", "PixelDiT", "pixeldit_t2i"),
    _dit("Lumina2", "Lumina Image 2.0", "lumina2"),
    _wan_family("WAN22_T2V", "Wan 2.2 TI2V 5B", model_type="t2v", out_dim=48),
    _wan_family(
        "WAN21_CausalAR_T2V", "Wan 2.1 causal (autoregressive) text-to-video", model_type="t2v", causal_ar=True
    ),
    _wan_family("WAN21_T2V", "Wan 2.1/2.2 text-to-video", model_type="t2v"),
    _wan_family("WAN21_I2V", "Wan 2.1 image-to-video", model_type="i2v", in_dim=36),
    _wan_family("WAN21_FunControl2V", "Wan 2.1 Fun Control", model_type="i2v", in_dim=48),
    _wan_family("WAN21_Vace", "Wan 2.1 VACE", model_type="vace"),
    _wan_family("WAN21_Camera", "Wan 2.1 camera control", model_type="camera", in_dim=32),
    _wan_family("WAN22_Camera", "Wan 2.2 camera control", model_type="camera_2.2", in_dim=36),
    _wan_family("WAN22_S2V", "Wan 2.2 speech-to-video", model_type="s2v"),
    _wan_family("WAN21_HuMo", "Wan 2.1 HuMo", model_type="humo"),
    _wan_family("WAN22_Animate", "Wan 2.2 Animate", model_type="animate"),
    _wan_family("WAN_Animate2", "Wan Animate 2", model_type="animate2"),  # image-to-video's tensors: told by metadata
    _wan_family("WAN21_FlowRVS", "Wan 2.1 FlowRVS", model_type="flow_rvs"),
    _wan_family("WAN21_SCAIL", "Wan 2.1 SCAIL", model_type="scail"),
    _wan_family("WAN21_SCAIL2", "Wan 2.1 SCAIL 2", model_type="scail2"),
    _wan_family("WAN22_WanDancer", "Wan 2.2 WanDancer", model_type="wandancer", in_dim=36),
    _dit("Hunyuan3Dv2mini", "Hunyuan3D 2 mini", "hunyuan3d2", dt=_ANY, depth=8),
    _dit("Hunyuan3Dv2", "Hunyuan3D 2", "hunyuan3d2", dt=_ANY),
    _dit("Hunyuan3Dv2_1", "Hunyuan3D 2.1", "hunyuan3d2_1", dt=_ANY),
    _dit("TripoSplat", "TripoSplat", "triposplat", dt=_ANY, **_OWN_VAE),
    _dit("HiDream", "HiDream-I1", "hidream"),
    _dit("HiDreamO1", "HiDream-O1", "hidream_o1"),
    _dit("Chroma", "Chroma", "flux", "chroma", "FLUX", _BF16_FIRST, **_OWN_VAE),
    _dit("SeedVR2", "SeedVR2", "seedvr2", dt=_BF16_FIRST, conditioning=True),
    _dit("ChromaRadiance", "Chroma Radiance", "flux", "chroma_radiance", "FLUX", _ANY, **_OWN_VAE),
    Family("ACEStep", "ACE-Step", "ace", {"audio_model": "ace"}, model_type="FLOW", dtypes=_BF16, **_DIT),
    Family("ACEStep15", "ACE-Step 1.5", "ace15", {"audio_model": "ace1.5"}, model_type="FLOW", dtypes=_BF16, **_DIT),
    Family("MiniMaxMusic3", "MiniMax Music 3", "minimax_music3", {"audio_model": "minimax_music3"}, model_type="FLOW"),
    _dit("Omnigen2", "OmniGen2", "omnigen2"),
    _dit("Boogu", "Boogu-Image", "boogu"),
    _dit("MageFlow", "Mage-Flow", "qwen_image", "mage_flow"),
    _dit("QwenImage", "Qwen-Image", "qwen_image", mt="FLUX"),
    _dit("JoyImage", "JoyImage", "joyimage"),
    _dit("Ideogram4", "Ideogram 4", "ideogram4"),
    _dit("Krea2", "Krea 2", "krea2", mt="FLUX", dt=_BF16_FIRST),
    _dit("Flux2", "Flux.2", "flux", "flux2", "FLUX", _BF16_FIRST),
    _dit("Lens", "Lens", "lens", mt="FLUX"),
    _dit("Kandinsky5Image", "Kandinsky 5.0 Image", "kandinsky5", model_dim=2560, visual_embed_dim=64),
    _dit("Kandinsky5", "Kandinsky 5.0 Video", "kandinsky5"),
    _dit("Anima", "Anima", "cosmos_predict2", "anima", dt=_BF16_FIRST, **_OWN_VAE),
    _dit("RT_DETR_v4", "RT-DETRv4 (object detection)", "rt_detr_v4", "RT_DETR_v4", dt=("fp16", "fp32"), **_OWN_VAE),
    _dit("ErnieImage", "ERNIE-Image", "ernie"),
    _dit("SAM3", "SAM 3 (segmentation)", "sam3", "SAM3", dt=_ANY, **_OWN_VAE),
    _dit("SAM31", "SAM 3.1 (segmentation)", "sam3", "SAM31", dt=_ANY, **_OWN_VAE),
    _dit("CogVideoX_Inpaint", "CogVideoX inpaint", "cogvideox", mt=_DDPM, dt=_BF16_FIRST, in_channels=48),
    _dit("CogVideoX_I2V", "CogVideoX image-to-video", "cogvideox", mt=_DDPM, dt=_BF16_FIRST, in_channels=32),
    _dit("CogVideoX_T2V", "CogVideoX", "cogvideox", mt=_DDPM, dt=_BF16_FIRST),
    Family(
        "SVD_img2vid", "Stable Video Diffusion", "unet", {**_SVD, "adm_in_channels": 768}, model_type="V_PREDICTION_EDM"
    ),
    _dit(
        "DepthAnything3",
        "Depth Anything 3 (depth estimation)",
        "depth_anything3",
        "DepthAnything3",
        dt=_ANY,
        **_OWN_VAE,
    ),
)


def match_family(branch: Branch, fields: Fields, view: KeyView) -> Family | None:
    """The first family of the table whose required fields and keys the file has."""
    return next((f for f in FAMILIES if f.branch == branch.name and not f.mismatches(fields, view)), None)
