"""Build the VAE ComfyUI's Load VAE builds from a VAE file, and fill it our way: weightless first, then each
weight written once, in the dtype chosen, in host memory (ComfyUI moves a VAE where it decodes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...core.detection.headers import FileHeader
from ...core.files.reader import WeightReader
from ...core.progress import ProgressCallback
from ...core.weights.ops import convert
from .filling import ComponentPlan, fill_models, is_comfy_layer
from .patcher import adopt
from .tracing import build_traced_vae


@dataclass
class BuiltVAE:
    """ComfyUI's VAE, plus what loading it found worth telling the user."""

    vae: Any
    notes: list[str] = field(default_factory=list)


def build_vae(header: FileHeader, place: ComponentPlan, progress: ProgressCallback | None = None) -> BuiltVAE:
    """The VAE ComfyUI's Load VAE builds from ``header``'s file, on ``place``'s device, in its dtype.

    Raises:
        ModelFileError: a tensor is missing or misshapen in the file.
    """
    notes: list[str] = []
    with WeightReader(header) as reader:
        vae, sources = build_traced_vae(header, reader, place)
        # As for a checkpoint's VAE: written to host memory, moved to its device by ComfyUI when it decodes.
        fill_models({"vae": vae.first_stage_model}, {"vae": sources}, reader, {"vae": None}, progress, notes)
    convert(vae.first_stage_model, accept=is_comfy_layer)
    adopt(vae.patcher, place.placement)
    return BuiltVAE(vae, notes)
