"""Upscale Image With Device: ComfyUI's Upscale Image (using Model), with the upscale model on the device chosen, on
every ComfyUI tested.

ComfyUI 0.33 gives an upscale model a patcher and loads it through it, so Move To GPU places one there. Before
(0.3.75, 0.28), its upscale node moves the model to its own device at each use and back to the CPU after: no
placement could hold. This node gives the model a patcher where ComfyUI gave it none (ComfyUI's classic one, as 0.33
does), places it with Move To GPU's engine, and upscales as ComfyUI's node does: tiles of 512 with an overlap of 32,
halved after an out-of-memory error down to 128, the image clamped to 0..1. The model stays where it was put.

It is placed whole, with no budget: its layers are spandrel's plain torch layers, which the engine does not stream
(and an upscale model, a few MB to a few hundred, weighs little beside the activations of a full-size tile).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..core.errors import DeviceControlError
from . import panel, surface
from .bridge.moves import move
from .load_model_types import check_inputs
from .placing import device_input
from .state import inventory

#: ComfyUI's tiles: their size, their overlap, and the least size an out-of-memory error halves them to.
TILE, OVERLAP, LEAST_TILE = 512, 32, 128


def with_patcher(upscale_model: Any) -> Any:
    """The upscale model with a patcher, as ComfyUI 0.33's loader gives it (a copy, so that the input is unchanged,
    where ComfyUI gave it none): ComfyUI's classic ``ModelPatcher`` over the same module."""
    if getattr(upscale_model, "patcher", None) is not None:
        return upscale_model
    mm = surface.model_management()
    given = copy.copy(upscale_model)
    given.patcher = surface.model_patcher_class()(
        upscale_model.model, load_device=mm.get_torch_device(), offload_device=mm.unet_offload_device()
    )
    return given


def upscale(upscale_model: Any, image: torch.Tensor) -> torch.Tensor:
    """ComfyUI's tiled upscale of ``image`` (batch, height, width, channels) with a placed ``upscale_model``, on
    the device its patcher computes on."""
    patcher = upscale_model.patcher
    surface.load_models_gpu([patcher])  # the placement holds: the pack's patcher keeps it
    device = patcher.load_device
    pixels = image.movedim(-1, -3).to(device)
    tile = TILE
    while True:
        try:
            out = surface.tiled_upscale(pixels, lambda a: upscale_model(a.float()), tile, OVERLAP, upscale_model.scale)
            break
        except torch.OutOfMemoryError:
            tile //= 2
            if tile < LEAST_TILE:
                raise
    return torch.clamp(out.movedim(-3, -1), min=0, max=1.0).to(surface.intermediate_device())


class UpscaleImageWithDevice(surface.io.ComfyNode):
    """Thin node: the placement is Move To GPU's; the tiling ComfyUI's."""

    @classmethod
    def define_schema(cls) -> Any:
        io = surface.io
        return io.Schema(
            node_id="DeviceControl_UpscaleImage",
            display_name="Upscale Image With Device",
            category="Device Control",
            description=(
                "Upscales an image with an upscale model (ESRGAN, SwinIR, ...) as ComfyUI's Upscale Image (using "
                "Model) does, tile by tile, with the model on the device you choose; it stays there after (whole: "
                "it is small beside its activations). On every ComfyUI: before 0.33, ComfyUI's own node moves the "
                "model to its device and back at each use."
            ),
            inputs=[
                io.Custom("UPSCALE_MODEL").Input("upscale_model", tooltip="From Load Upscale Model."),
                io.Image.Input("image", tooltip="The image to upscale."),
                device_input("device", "upscale model"),
            ],
            hidden=[io.Hidden.unique_id],
            outputs=[
                io.Image.Output(tooltip="The upscaled image."),
                io.Custom("UPSCALE_MODEL").Output(
                    "placed",
                    display_name="upscale_model",
                    tooltip="The upscale model where it was placed (for the next upscale: it stays there).",
                ),
                io.String.Output("summary", display_name="summary", tooltip="Where the model computed, and the size."),
            ],
        )

    @classmethod
    def validate_inputs(cls, device: str) -> bool | str:
        return check_inputs("Upscale Image With Device", cls, device, None, None)

    @classmethod
    def execute(cls, upscale_model: Any, image: Any, device: str) -> Any:
        if not hasattr(upscale_model, "scale") or not hasattr(upscale_model, "model"):
            raise DeviceControlError("upscale_model takes an UPSCALE_MODEL, from Load Upscale Model.")
        placed = move(with_patcher(upscale_model), device, "all", False, inventory)
        out = upscale(placed.value, image)
        size = f"{image.shape[2]}x{image.shape[1]} to {out.shape[2]}x{out.shape[1]}"
        text = f"upscaled {size} (x{placed.value.scale:g})\n{placed.text}"
        panel.announce()
        # The placed model is an output too: ComfyUI's cache holds it, and with it the placement (ComfyUI lets go
        # of a loaded model nothing holds).
        return surface.io.NodeOutput(out, placed.value, text, ui={"text": (text,)})
