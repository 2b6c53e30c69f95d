"""Build the CLIP ComfyUI's CLIP loaders build from one to four text-encoder files, and fill it our way:
weightless first (ComfyUI's own choice of classes for the type and files), then each weight written once, in the
dtype chosen, where it goes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...core.detection.headers import FileHeader
from ...core.errors import DeviceControlError
from ...core.files.fileset import FileSet
from ...core.progress import ProgressCallback
from ...core.weights.ops import convert
from .. import surface
from .filling import ComponentPlan, fill_models, fill_target, first_load, is_comfy_layer, is_cuda
from .patcher import adopt
from .tracing import build_traced_text_encoders

#: A key ComfyUI's older scaled-fp8 files carry (the layers' scales sit beside their weights).
SCALED_FP8 = "scaled_fp8"


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
        DeviceControlError: a file in a format whose weights ComfyUI builds while reading them.
        ModelFileError: a tensor is missing or misshapen in a file.
    """
    _refuse_quantized(headers)
    notes: list[str] = []
    options: dict[str, Any] = {}
    if place.device is not None:
        options |= {"load_device": place.device, "offload_device": torch.device("cpu")}  # as for a checkpoint's
    if place.dtype is not None:
        options["dtype"] = place.dtype
    with FileSet(headers, pin_staging=is_cuda(place.device)) as files:
        clip, sources = build_traced_text_encoders(files, surface.clip_type(clip_type), options)
        fill = {"clip": fill_target(place)}
        fill_models({"clip": clip.cond_stage_model}, {"clip": sources}, files, fill, progress, notes)
    convert(clip.cond_stage_model, accept=is_comfy_layer)  # casts and patches run our code, as for checkpoints
    adopt(clip.patcher, place.placement)
    first_load(clip.patcher, place, fill["clip"])
    return BuiltClip(clip, notes)


def _refuse_quantized(headers: list[FileHeader]) -> None:
    """ComfyUI 0.2x turns scaled-fp8 text encoders into its quantized format while reading them, which cannot be
    traced weightless; refuse those before anything is read."""
    if surface.old_quants_converter() is None:
        return  # an older ComfyUI builds scaled-fp8 layers whose weights stream like any other
    for header in headers:
        if SCALED_FP8 in header.tensors or "_quantization_metadata" in header.metadata:
            raise DeviceControlError(
                f"{header.path} stores its layers in ComfyUI's scaled or quantized fp8 format, whose weights this "
                "ComfyUI builds while reading them; Device Control cannot stream those yet. Load it with ComfyUI's "
                "Load CLIP (or the Dual/Triple/Quadruple loader), or use the fp16 file with fp8_e4m3fn as dtype."
            )
