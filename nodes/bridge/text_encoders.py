"""Build the CLIP ComfyUI's CLIP loaders build from one to four text-encoder files, and fill it our way:
weightless first (ComfyUI's own choice of classes for the type and files), then each weight written once, in the
dtype chosen, where it goes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...core.detection.headers import FileHeader
from ...core.files.fileset import FileSet
from ...core.progress import ProgressCallback
from ...core.weights.ops import convert
from .. import surface
from .filling import ComponentPlan, fill_models, fill_target, first_load, is_comfy_layer
from .patcher import adopt
from .tracing import build_traced_text_encoders


@dataclass
class BuiltClip:
    """ComfyUI's CLIP, plus what loading it found worth telling the user."""

    clip: Any
    notes: list[str] = field(default_factory=list)


def build_text_encoders(
    headers: list[FileHeader], clip_type: str, place: ComponentPlan, progress: ProgressCallback | None = None
) -> BuiltClip:
    """The CLIP ComfyUI's CLIP loaders build from ``headers``' files as ``clip_type``, placed as ``place`` says.

    Raises:
        ModelFileError: a tensor is missing or misshapen in a file.
    """
    notes: list[str] = []
    options: dict[str, Any] = {}
    if place.device is not None:
        options |= {"load_device": place.device, "offload_device": torch.device("cpu")}  # as for a checkpoint's
    if place.dtype is not None:
        options["dtype"] = place.dtype
    with FileSet(headers, pin_for=fill_target(place)) as files:
        clip, sources = build_traced_text_encoders(files, surface.clip_type(clip_type), options)
        fill = {"clip": fill_target(place)}
        fill_models({"clip": clip.cond_stage_model}, {"clip": sources}, files, fill, progress, notes)
    convert(clip.cond_stage_model, accept=is_comfy_layer)  # casts and patches run our code, as for checkpoints
    adopt(clip.patcher, place.placement)
    first_load(clip.patcher, place, fill["clip"])
    return BuiltClip(clip, notes)
