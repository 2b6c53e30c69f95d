"""Release a template written on the test fixtures: the files and settings users get.

``tools.templates.make_workflows`` writes the SD1.5 graphs on the fixtures (so their structure is what the tests run)
and passes each one here: the fixture files are named as the released files, sampling takes SD1.5's real settings, and
each loader lists the files it names in ``properties.models`` (name, url, directory), which the frontend's
missing-model dialog offers to download. ``tools.templates.workflow_api.for_fixtures`` is the way back, for the tests.
"""

from __future__ import annotations

from typing import Any

from tools.fixtures.make import SD15_CHECKPOINT, SD15_CHECKPOINT_B, SD15_CLIP_L, SD15_LORA, SD15_UNET, SD15_VAE
from tools.templates.models import MODELS, SD15_CONTROLNET, UPSCALER

#: The fixture files of the SD1.5 graphs below -> the released files their workflow names.
RELEASED_SD15 = {
    SD15_CHECKPOINT: "v1-5-pruned-emaonly-fp16.safetensors",
    SD15_CHECKPOINT_B: "DreamShaper_8_pruned.safetensors",
    SD15_LORA: "lcm-lora-sdv1-5.safetensors",
    SD15_UNET: "sd15_unet_fp16.safetensors",
    SD15_CLIP_L: "clip_l.safetensors",
    SD15_VAE: "vae-ft-mse-840000-ema-pruned.safetensors",
    SD15_CONTROLNET: "control_v11p_sd15_canny_fp16.safetensors",
    UPSCALER: "RealESRGAN_x4plus.safetensors",
}
#: SD1.5 sampling that gives a real image: 512x512, 20 steps at cfg 7 (with the LCM LoRA: 6 steps at cfg 1.5).
SD15_SIZE, SD15_STEPS, SD15_CFG = 512, 20, 7.0
LCM_SAMPLING = (6, 1.5, "lcm", "sgm_uniform")


def _release_widgets(kind: str, values: list[Any], lcm: bool) -> list[Any]:
    values = [RELEASED_SD15.get(v, v) if isinstance(v, str) else v for v in values]
    if kind == "EmptyLatentImage" and values[:2] == [64, 64]:
        values[:2] = [SD15_SIZE, SD15_SIZE]
    if kind == "KSampler" and values[2] == 1:  # written at the fixtures' one step
        values[2:6] = list(LCM_SAMPLING) if lcm else [SD15_STEPS, SD15_CFG, *values[4:6]]
    return values


def release(workflow: dict[str, Any]) -> dict[str, Any]:
    """``workflow`` as users get it: the SD1.5 fixtures named as the released files, sampling at SD1.5's real
    settings, and each loader's ``properties.models`` listing the files it names (name, url, directory)."""
    lora = {SD15_LORA, RELEASED_SD15[SD15_LORA]}
    lcm = any(lora & set(map(str, n.get("widgets_values") or [])) for n in workflow["nodes"])
    for node in workflow["nodes"]:
        values = node.get("widgets_values")
        if node["type"] == "Note" or not isinstance(values, list):
            continue
        node["widgets_values"] = values = _release_widgets(node["type"], values, lcm)
        models = [MODELS[v].metadata() for v in values if isinstance(v, str) and v in MODELS]
        if models:
            node.setdefault("properties", {})["models"] = models
    return workflow
