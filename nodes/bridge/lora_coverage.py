"""How much of a LoRA applies to a model, by ComfyUI's own key map for that model.

A LoRA names the layers it adapts; ComfyUI's key map for a model (``comfy.lora.model_lora_keys_unet`` for a
diffusion model, ``model_lora_keys_clip`` for a text encoder) lists every name it accepts for each weight, in
every naming it knows (kohya, diffusers, PEFT, its own). A layer applies when its name is in that map, the very
test ComfyUI's LoRA loader makes. When a LoRA reaches a model Device Control loaded, the patcher says how much
of it that model takes, and warns when none of it does (a LoRA made for another family, or a naming ComfyUI
does not map), which ComfyUI itself only shows as a stream of "lora key not loaded" lines.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ...core.detection.headers import read_header
from ...core.detection.lora_info import layer_names
from ...core.errors import ModelFileError
from .. import surface
from .subjects import component_of, model_label

log = logging.getLogger("device_control")


@dataclass(frozen=True)
class Coverage:
    """Of a LoRA's ``layers``, how many patch a model (``applied``)."""

    layers: int
    applied: int

    def text(self, file: str, model: str) -> str:
        """``LoRA 'x.safetensors' patches 128 of its 176 layers in SD15 diffusion model``, and why when none."""
        head = f"LoRA {file!r} patches {self.applied} of its {self.layers} layers in {model}"
        if self.applied:
            return head + ("" if self.applied == self.layers else " (the others are for another part of the model)")
        return head + (
            ": none of it applies. It was made for another model family, or uses names ComfyUI does not map; "
            "check that the LoRA matches the model"
        )


def key_map(patcher: Any) -> dict[str, Any]:
    """ComfyUI's LoRA key map for ``patcher``'s model: every accepted layer name, to the weight it patches."""
    lora, model = surface.comfy_lora(), patcher.model
    if component_of(model) == "CLIP":
        return lora.model_lora_keys_clip(model, {})
    return lora.model_lora_keys_unet(model, {})


def coverage(layers: Collection[str], patcher: Any) -> Coverage:
    """How many of a LoRA's ``layers`` (names as :func:`core.detection.lora_info.layer_names` gives them)
    ComfyUI's key map for ``patcher``'s model takes."""
    accepted = key_map(patcher)
    return Coverage(len(layers), sum(1 for name in layers if name in accepted))


def report_coverage(patcher: Any, file: str) -> Coverage | None:
    """Log how much of LoRA ``file`` (a name in ComfyUI's ``loras`` folders) ``patcher``'s model takes; a
    warning when nothing does. ``None`` when the file cannot be found or read (nothing is said)."""
    path = surface.folder_paths().get_full_path("loras", file)
    if not path:
        return None
    try:
        names = read_header(path).tensors
    except ModelFileError:
        return None
    found = coverage(layer_names(names), patcher)
    text = found.text(file, model_label(patcher))
    (log.info if found.applied else log.warning)("[Device Control] %s", text)
    return found
