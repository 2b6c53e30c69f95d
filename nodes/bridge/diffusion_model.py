"""Build a diffusion-model file's MODEL with ComfyUI's own classes, as ComfyUI's Load Diffusion Model does, and
fill it our way: weightless first, then each weight written once, in the dtype chosen, where it goes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...core.detection.detect import Detection
from ...core.detection.ggml_types import file_type_name
from ...core.detection.headers import FileHeader
from ...core.files.reader import WeightReader
from ...core.progress import ProgressCallback
from ...core.weights.ops import convert
from .. import surface
from .filling import (
    ComponentPlan,
    fill_models,
    fill_target,
    first_load,
    is_comfy_layer,
    set_unet_dtype,
    torch_device,
)
from .patcher import DeviceControlPatcher
from .storage import GGUF_FILE_TYPE
from .tracing import build_traced_model, diffusion_config_of, stand_ins


@dataclass
class BuiltModel:
    """ComfyUI's MODEL, plus what loading it found worth telling the user."""

    model: Any
    notes: list[str] = field(default_factory=list)


def build_diffusion_model(
    header: FileHeader,
    detection: Detection,
    place: ComponentPlan,
    *,
    fp8_optimizations: bool = False,
    progress: ProgressCallback | None = None,
) -> BuiltModel:
    """The MODEL ComfyUI's Load Diffusion Model builds from this file, on ``place``'s device in its dtype.

    ``fp8_optimizations``: ComfyUI's ``fp8_e4m3fn_fast`` (fp8 matrix multiplications where the device has them).

    Raises:
        UnknownModelError: ComfyUI cannot build this file, or builds a different class than detected.
        ModelFileError: a tensor is missing or misshapen in the file.
    """
    notes: list[str] = []
    with WeightReader(header, pin_for=fill_target(place)) as reader:
        sd = stand_ins(header, reader)
        config, sd = diffusion_config_of(sd, header, detection)
        compute = set_unet_dtype(config, sd, "", place)
        if fp8_optimizations:
            config.optimizations["fp8"] = True
        model, sources = build_traced_model(config, sd, header, reader)
        fill = {"model": fill_target(place)}
        fill_models({"model": model}, {"model": sources}, reader, fill, progress, notes)
    model.device = torch_device(fill["model"])
    if header.format == "gguf":  # VRAM Report names the model by it (Q4_K_M), beside its block types
        setattr(model, GGUF_FILE_TYPE, file_type_name(header.metadata))
    convert(model, accept=is_comfy_layer)  # ComfyUI's standard layers become ours: casts and patches run our code
    patcher = DeviceControlPatcher(
        model, load_device=compute, offload_device=surface.model_management().unet_offload_device()
    )
    patcher.device_control_placement = place.placement
    first_load(patcher, place, fill["model"])
    return BuiltModel(patcher, notes)
