"""Build a checkpoint's MODEL, CLIP and VAE with ComfyUI's own classes, and fill them our way.

The models are built weightless and their sources traced (``tracing``); then each parameter is allocated
once, in the dtype ComfyUI chose for it and on the device we chose, and streamed from the file
(``core.files.skeleton``). The result is what ComfyUI builds, tensor for tensor, at a fraction of the peak
memory; its patchers carry the placements chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...core.detection.detect import Detection
from ...core.detection.headers import FileHeader
from ...core.errors import UnknownModelError
from ...core.files.reader import WeightReader
from ...core.progress import ProgressCallback
from ...core.weights.ops import convert
from .. import surface
from .filling import (
    ComponentPlan,
    Fills,
    fill_models,
    fill_target,
    first_load,
    is_comfy_layer,
    set_unet_dtype,
    torch_device,
)
from .patcher import DeviceControlPatcher, adopt
from .storage import dominant_storage
from .tracing import Traced, build_traced, config_of, stand_ins


@dataclass
class BuiltCheckpoint:
    """ComfyUI's three objects, plus what loading them found worth telling the user."""

    model: Any
    clip: Any
    vae: Any
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Places:
    """The three components' plans, by role."""

    unet: ComponentPlan
    clip: ComponentPlan
    vae: ComponentPlan


def build_checkpoint(
    header: FileHeader,
    detection: Detection,
    placements: dict[str, ComponentPlan],
    progress: ProgressCallback | None = None,
) -> BuiltCheckpoint:
    """Build ``header``'s file as ComfyUI would, with each component placed as ``placements`` says.

    Args:
        header: the file's header.
        detection: our detection of it (its ComfyUI class is cross-checked with ComfyUI's own detection).
        placements: by role: ``"diffusion_model"``, ``"text_encoder"``, ``"vae"``.
        progress: called with (bytes done, bytes total) while weights stream in; may raise to interrupt.

    Raises:
        UnknownModelError: ComfyUI cannot build this file, or builds a different class than detected.
        ModelFileError: a tensor is missing or misshapen in the file.
    """
    places = _Places(*(placements.get(role, ComponentPlan()) for role in ("diffusion_model", "text_encoder", "vae")))
    filled_on_a_device = fill_target(places.unet) or fill_target(places.clip)
    notes: list[str] = []
    with WeightReader(header, pin_for=filled_on_a_device) as reader:
        sd = stand_ins(header, reader)
        config, prefix = config_of(sd, header, detection)
        compute = set_unet_dtype(config, sd, prefix, places.unet)
        traced = build_traced(config, sd, prefix, header, reader, places)
        # The VAE is always written to host memory: ComfyUI moves it to its device when it decodes.
        fill = {"model": fill_target(places.unet), "clip": fill_target(places.clip), "vae": None}
        fill_models(traced.roots, traced.sources, reader, fill, progress, notes)
    traced.model.device = torch_device(fill["model"])
    for root in traced.roots.values():  # ComfyUI's standard layers become ours: casts and patches run our code
        convert(root, accept=is_comfy_layer)
    patcher = DeviceControlPatcher(
        traced.model,
        load_device=compute,
        offload_device=surface.model_management().unet_offload_device(),
    )
    patcher.device_control_placement = places.unet.placement
    _adopt_and_register(patcher, traced, places, fill)
    return BuiltCheckpoint(patcher, traced.clip, traced.vae, notes)


def _adopt_and_register(patcher: Any, traced: Traced, places: _Places, fill: Fills) -> None:
    """The text encoder's and the VAE's patchers carry their placements; ComfyUI learns where each model is."""
    if traced.clip is not None:
        adopt(traced.clip.patcher, places.clip.placement)
    adopt(traced.vae.patcher, places.vae.placement)
    first_load(patcher, places.unet, fill["model"])
    if traced.clip is not None:
        first_load(traced.clip.patcher, places.clip, fill["clip"])


_STORED = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def default_dtype(role: str, device: torch.device, detection: Detection) -> torch.dtype:
    """The storage dtype ComfyUI picks for ``role`` on ``device`` (its ``unet_dtype`` and friends)."""
    mm = surface.model_management()
    if role == "diffusion_model":
        unet = detection.component("diffusion_model")[0]
        family = getattr(surface.supported_models(), detection.comfy_class, None)
        if family is None:
            raise UnknownModelError(
                f"{detection.path} is a {detection.family} ({detection.comfy_class}), which this ComfyUI "
                f"({surface.comfyui_version()}) cannot build; update ComfyUI to load it."
            )
        stored = _STORED.get(unet.stored_dtypes[0]) if len(unet.stored_dtypes) == 1 else None
        return mm.unet_dtype(
            device=device,
            model_params=unet.parameter_count,
            supported_dtypes=family.supported_inference_dtypes,
            weight_dtype=stored,
        )
    if role == "text_encoder":
        return mm.text_encoder_dtype(device)
    return mm.vae_dtype(device)


def built_dtypes(built: BuiltCheckpoint) -> dict[str, str]:
    """How each part is stored (and, for the diffusion model, computed) now that it is loaded."""
    model = built.model.model
    cast = getattr(model, "manual_cast_dtype", None)
    unet = _name(model.get_dtype()) + (f" (computes in {_name(cast)})" if cast is not None else "")
    clip = built.clip.cond_stage_model if built.clip is not None else None
    return {
        "diffusion_model": unet,
        "text_encoder": (dominant_storage(clip) or "-") if clip is not None else "-",
        "vae": _name(built.vae.vae_dtype),
    }


def _name(dtype: torch.dtype | None) -> str:
    return str(dtype).replace("torch.", "") if dtype is not None else "-"
