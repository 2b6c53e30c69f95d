"""ComfyUI's own detection, for a file our table does not know or names a class the running ComfyUI lacks.

ComfyUI grows new families every month (0.28 builds 96 classes); our header rules follow the newest ComfyUI
tested, which is neither ahead of nor behind every user's. Such a file is asked of the running ComfyUI before
it is refused: if ComfyUI builds a class for it, the file is described as that class (its components found and
weighed like any other, by our VAE and text-encoder rules) and the family name says that ComfyUI recognised it.
"""

from __future__ import annotations

import logging

import torch

from ...core.detection.detect import Detection, detection_for, single_component
from ...core.detection.family_table import Family
from ...core.detection.headers import FileHeader
from ...core.files.reader import WeightReader
from .. import surface
from .tracing import stand_ins

log = logging.getLogger("device_control")

_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
#: What the family name adds, so every summary and report shows where the detection came from.
COMFY_DETECTED = "as the running ComfyUI's own detection recognises it"


def detect_with_comfyui(header: FileHeader) -> Detection | None:
    """The file as ComfyUI's detection sees it, or ``None`` when ComfyUI builds nothing from it either."""
    with WeightReader(header) as reader:
        sd = stand_ins(header, reader)
    detect = surface.model_detection()
    # A checkpoint's diffusion model sits under a prefix; a diffusion-model-only file has none (UNETLoader).
    try:
        for prefix in dict.fromkeys((detect.unet_prefix_from_state_dict(sd), "")):
            config = detect.model_config_from_unet(sd, prefix, metadata=dict(header.metadata))
            if config is not None:
                break
        else:
            return None
    except Exception as exc:  # ComfyUI's detection assumes a file it half-recognises is whole
        log.warning(
            "[Device Control] %s: ComfyUI's detection failed on it too (%s: %s)", header.path, type(exc).__name__, exc
        )
        return None
    name = type(config).__name__
    family = Family(
        name,
        f"{name} ({COMFY_DETECTED})",
        "comfyui",
        # The prediction type is decided when ComfyUI builds the model (many classes override it there).
        model_type="prediction type as ComfyUI builds it",
        vae_prefix=config.vae_key_prefix[0] if config.vae_key_prefix else "",
        dtypes=tuple(_DTYPE_NAMES[d] for d in config.supported_inference_dtypes if d in _DTYPE_NAMES),
    )
    log.warning("[Device Control] %s: loaded as %s, %s", header.path, name, COMFY_DETECTED)
    return detection_for(header, family, prefix)


def text_encoder_with_comfyui(header: FileHeader) -> Detection | None:
    """The file as a text encoder ComfyUI's CLIP loaders recognise (``detect_te_model``), or ``None``."""
    with WeightReader(header) as reader:
        sd = stand_ins(header, reader)
    try:
        found = surface.comfy_sd().detect_te_model(sd)
    except Exception as exc:  # ComfyUI's detection assumes a file it half-recognises is whole
        log.warning("[Device Control] %s: ComfyUI's text-encoder detection failed on it (%s)", header.path, exc)
        return None
    if found is None:
        return None
    log.warning("[Device Control] %s: a %s text encoder, %s", header.path, found.name, COMFY_DETECTED)
    return single_component(header, "text_encoder", f"{found.name} ({COMFY_DETECTED})")
