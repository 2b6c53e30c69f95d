"""The released model files the example workflows name, where to download each, and the synthetic file the tests
put in its place.

The workflows in ``workflows/`` are for users: they name the files users download (from ComfyUI's own examples and
the Comfy-Org repackaged repositories where those exist) and carry the frontend's model metadata, so its
missing-model dialog offers the download. The tests, the demo and the thumbnails run the same files on the small
synthetic models ``tools/fixtures/make.py`` writes: :func:`tools.templates.workflow_api.for_fixtures` swaps each name
here for
its fixture and shrinks sizes and steps. Nothing here imports torch: the demo reads it before the runtime exists.
"""

from __future__ import annotations

from dataclasses import dataclass

HF = "https://huggingface.co"
#: The fixture files (the names ``tools/fixtures/make.py`` and ``tools/fixtures/families.py`` write).
SD15_CHECKPOINT = "device_control_sd15_synthetic.safetensors"
SD15_CHECKPOINT_B = "device_control_sd15_synthetic_b.safetensors"
SD15_LORA = "device_control_sd15_lora_r4.safetensors"
SD15_UNET = "device_control_sd15_unet.safetensors"
SD15_CLIP_L = "device_control_sd15_clip_l.safetensors"
SD15_VAE = "device_control_sd15_vae.safetensors"
CLIP_G = "device_control_clip_g.safetensors"
VAE_16CH = "device_control_vae_16ch.safetensors"
WAN21_VAE = "device_control_wan21_vae.safetensors"
SD15_CONTROLNET = "device_control_controlnet_sd15.safetensors"
UPSCALER = "device_control_esrgan_tiny_x2.safetensors"
SIGLIP_VISION = "device_control_siglip_vision_384.safetensors"
FLUX_REDUX = "device_control_flux_redux.safetensors"


@dataclass(frozen=True)
class Model:
    """A released file: its name in the models folder, where to download it, its folder, and its test stand-in."""

    name: str
    url: str
    directory: str
    fixture: str

    def metadata(self) -> dict[str, str]:
        """The entry of a node's ``properties.models`` the frontend reads (name, url, directory)."""
        return {"name": self.name, "url": self.url, "directory": self.directory}


def _model(name: str, path: str, directory: str, fixture: str) -> Model:
    return Model(name, f"{HF}/{path}", directory, fixture)


_FLUX_TE = "comfyanonymous/flux_text_encoders/resolve/main"
_SD35 = "Comfy-Org/stable-diffusion-3.5-fp8/resolve/main"
_WAN = "Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files"
_WAN22 = "Comfy-Org/Wan_2.2_ComfyUI_Repackaged/resolve/main/split_files"
MODELS = {
    model.name: model
    for model in (
        _model(
            "v1-5-pruned-emaonly-fp16.safetensors",
            "Comfy-Org/stable-diffusion-v1-5-archive/resolve/main/v1-5-pruned-emaonly-fp16.safetensors",
            "checkpoints",
            SD15_CHECKPOINT,
        ),
        _model(
            "DreamShaper_8_pruned.safetensors",
            "Lykon/DreamShaper/resolve/main/DreamShaper_8_pruned.safetensors",
            "checkpoints",
            SD15_CHECKPOINT_B,
        ),
        # Released as pytorch_lora_weights.safetensors; saved under the name ComfyUI users give it.
        _model(
            "control_v11p_sd15_canny_fp16.safetensors",
            "comfyanonymous/ControlNet-v1-1_fp16_safetensors/resolve/main/control_v11p_sd15_canny_fp16.safetensors",
            "controlnet",
            SD15_CONTROLNET,
        ),
        _model(
            "RealESRGAN_x4plus.safetensors",
            "Comfy-Org/Real-ESRGAN_repackaged/resolve/main/RealESRGAN_x4plus.safetensors",
            "upscale_models",
            UPSCALER,
        ),
        _model(
            "lcm-lora-sdv1-5.safetensors",
            "latent-consistency/lcm-lora-sdv1-5/resolve/main/pytorch_lora_weights.safetensors",
            "loras",
            SD15_LORA,
        ),
        # The SD1.5 and SDXL UNets ship in diffusers folders under one file name; saved under a name of their own.
        _model(
            "sd15_unet_fp16.safetensors",
            "stable-diffusion-v1-5/stable-diffusion-v1-5/resolve/main/unet/diffusion_pytorch_model.fp16.safetensors",
            "diffusion_models",
            SD15_UNET,
        ),
        _model(
            "sdxl_unet_fp16.safetensors",
            "stabilityai/stable-diffusion-xl-base-1.0/resolve/main/unet/diffusion_pytorch_model.fp16.safetensors",
            "diffusion_models",
            "device_control_sdxl_vega.safetensors",
        ),
        _model(
            "vae-ft-mse-840000-ema-pruned.safetensors",
            "stabilityai/sd-vae-ft-mse-original/resolve/main/vae-ft-mse-840000-ema-pruned.safetensors",
            "vae",
            SD15_VAE,
        ),
        _model("sdxl_vae.safetensors", "stabilityai/sdxl-vae/resolve/main/sdxl_vae.safetensors", "vae", SD15_VAE),
        _model("clip_l.safetensors", f"{_FLUX_TE}/clip_l.safetensors", "text_encoders", SD15_CLIP_L),
        _model("clip_g.safetensors", f"{_SD35}/text_encoders/clip_g.safetensors", "text_encoders", CLIP_G),
        _model("t5xxl_fp8_e4m3fn.safetensors", f"{_FLUX_TE}/t5xxl_fp8_e4m3fn.safetensors", "text_encoders", "none"),
        _model(
            "t5xxl_fp8_e4m3fn_scaled.safetensors",
            f"{_SD35}/text_encoders/t5xxl_fp8_e4m3fn_scaled.safetensors",
            "text_encoders",
            "none",
        ),
        _model(
            "sd3.5_large.safetensors",
            "stabilityai/stable-diffusion-3.5-large/resolve/main/sd3.5_large.safetensors",
            "diffusion_models",
            "device_control_sd35_large_d4.safetensors",
        ),
        # The SD3.5 VAE ships in the diffusers folder of the same repository; saved under a name of its own.
        _model(
            "sd3.5_vae.safetensors",
            "stabilityai/stable-diffusion-3.5-large/resolve/main/vae/diffusion_pytorch_model.safetensors",
            "vae",
            VAE_16CH,
        ),
        _model(
            "flux1-dev.safetensors",
            "black-forest-labs/FLUX.1-dev/resolve/main/flux1-dev.safetensors",
            "diffusion_models",
            "device_control_flux_dev_d1.safetensors",
        ),
        _model("ae.safetensors", "black-forest-labs/FLUX.1-schnell/resolve/main/ae.safetensors", "vae", VAE_16CH),
        _model(
            "flux1-dev-Q8_0.gguf",
            "city96/FLUX.1-dev-gguf/resolve/main/flux1-dev-Q8_0.gguf",
            "diffusion_models",
            "device_control_flux_dev_d1_Q8_0.gguf",
        ),
        _model(
            "Chroma1-HD.safetensors",
            "lodestones/Chroma1-HD/resolve/main/Chroma1-HD.safetensors",
            "diffusion_models",
            "device_control_chroma_d1.safetensors",
        ),
        _model(
            "wan2.1_t2v_14B_fp8_e4m3fn.safetensors",
            f"{_WAN}/diffusion_models/wan2.1_t2v_14B_fp8_e4m3fn.safetensors",
            "diffusion_models",
            "device_control_wan21_t2v_small.safetensors",
        ),
        _model(
            "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
            f"{_WAN}/text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors",
            "text_encoders",
            "none",
        ),
        _model("wan_2.1_vae.safetensors", f"{_WAN}/vae/wan_2.1_vae.safetensors", "vae", WAN21_VAE),
        _model(
            "sigclip_vision_patch14_384.safetensors",
            "Comfy-Org/sigclip_vision_384/resolve/main/sigclip_vision_patch14_384.safetensors",
            "clip_vision",
            SIGLIP_VISION,
        ),
        _model(
            "flux1-redux-dev.safetensors",
            "black-forest-labs/FLUX.1-Redux-dev/resolve/main/flux1-redux-dev.safetensors",
            "style_models",
            FLUX_REDUX,
        ),
        # Wan 2.2's two experts: the small Wan 2.1 fixture stands in for each (the same architecture).
        *(
            _model(
                f"wan2.2_t2v_{noise}_noise_14B_fp8_scaled.safetensors",
                f"{_WAN22}/diffusion_models/wan2.2_t2v_{noise}_noise_14B_fp8_scaled.safetensors",
                "diffusion_models",
                "device_control_wan21_t2v_small.safetensors",
            )
            for noise in ("high", "low")
        ),
    )
}

#: The text-encoder type a released workflow names -> the fixture's encoders and type: the fixtures condition on
#: CLIP-L (and CLIP-G for SDXL) loaded as ComfyUI's ``sd3`` type (``sdxl`` for SDXL).
TEXT_ENCODER_FIXTURES = {
    "sdxl": ((SD15_CLIP_L, CLIP_G), "sdxl"),
    **dict.fromkeys(("sd3", "flux", "chroma", "wan"), ((SD15_CLIP_L,), "sd3")),
}

#: What the tests sample at: one step at cfg 1 on a 64x64 latent (five frames for video), as fast as before.
FIXTURE_SIZE, FIXTURE_FRAMES, FIXTURE_STEPS, FIXTURE_CFG = 64, 5, 1, 1.0


#: Released files behind a login: a gated repository, whose licence is accepted on its page first.
GATED = frozenset({"flux1-dev.safetensors", "sd3.5_large.safetensors", "flux1-redux-dev.safetensors"})
#: What a released file's download size is computed from (``tests/core/test_template_downloads.py``): the layout
#: of the model it holds (``tests/data/model_layouts.json.gz``) and the bytes a parameter takes in the published
#: file, where that is not the layout's own dtype (``None``: as the layout).
DOWNLOAD_LAYOUTS: dict[str, tuple[str, float | None]] = {
    "flux1-dev.safetensors": ("flux1_dev.diffusion_model.json", None),
    "flux1-dev-Q8_0.gguf": ("flux1_dev.diffusion_model.json", 34 / 32),  # Q8_0: 32 bytes and a 2-byte scale a block
    "sd3.5_large.safetensors": ("sd35_large.diffusion_model.json", None),
    "Chroma1-HD.safetensors": ("chroma.diffusion_model.json", None),
    "wan2.1_t2v_14B_fp8_e4m3fn.safetensors": ("wan21_t2v_14b.diffusion_model.json", 1),
    "sdxl_unet_fp16.safetensors": ("sdxl_base.diffusion_model.json", None),
    "clip_l.safetensors": ("te_clip_l.json", None),
    "clip_g.safetensors": ("te_clip_g.json", None),
    "t5xxl_fp8_e4m3fn.safetensors": ("te_t5xxl_fp8_e4m3fn_scaled.json", None),
    "t5xxl_fp8_e4m3fn_scaled.safetensors": ("te_t5xxl_fp8_e4m3fn_scaled.json", None),
    "ae.safetensors": ("vae_flux_sd3_16ch.json", None),
    "sdxl_vae.safetensors": ("vae_sdxl.json", None),
    "wan_2.1_vae.safetensors": ("vae_wan21.json", None),
}
