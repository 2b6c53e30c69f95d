"""Move To GPU: put a model (a MODEL, CLIP, VAE, ControlNet, CLIP vision model, upscale model, model patch
or GLIGEN) on a device, under a VRAM budget, at this point of the graph."""

from __future__ import annotations

import logging
from typing import Any

from ..core.devices.inventory import parse_device_spec
from ..core.errors import InvalidDeviceSpecError, InvalidSizeError
from ..core.placement.budget import Budget
from . import panel, surface
from .bridge.moves import MoveResult, move
from .bridge.subjects import PLACEABLE_KINDS
from .cached_texts import remember
from .device_warnings import warn_missing_devices
from .state import device_options, device_tooltip, inventory

log = logging.getLogger("device_control")

#: The types the model input takes, and its output's (the editor narrows the output to the type connected to the
#: input: ``web/panel/device_warnings.js``), as ComfyUI writes them.
MODEL_IO_TYPE = ",".join(PLACEABLE_KINDS)
MODEL_TOOLTIP = (
    "A MODEL, CLIP or VAE from any loader (ComfyUI's own or Load Checkpoint With Device), or a CONTROL_NET, "
    "CLIP_VISION, UPSCALE_MODEL (ComfyUI 0.33 on), MODEL_PATCH or GLIGEN from ComfyUI's loaders."
)
MOVED_TOOLTIP = (
    "The same model (a clone that carries the placement), of the type connected to the input: a CLIP in, a CLIP out."
)


def model_input(optional: bool = False) -> Any:
    """The input that takes a model of any of :data:`PLACEABLE_KINDS`."""
    io = surface.io
    types = [io.Model, io.Clip, io.Vae, *(io.Custom(kind) for kind in PLACEABLE_KINDS[3:])]
    return io.MultiType.Input("model", types=types, optional=optional, tooltip=MODEL_TOOLTIP)


def model_output() -> Any:
    """The output that gives back what came in: typed with every kind here, narrowed by the editor to the type
    connected to the input. (ComfyUI's MatchType would do that where it works, 0.28 on; on 0.3.75 it does not, and
    the node's Info would read COMFY_MATCHTYPE_V3: one mechanism for every ComfyUI and frontend tested.)"""
    return surface.io.Custom(MODEL_IO_TYPE).Output("moved", display_name="model", tooltip=MOVED_TOOLTIP)


def trigger_input() -> Any:
    """An optional value of any type, passed through, to order this node in the graph."""
    return surface.io.AnyType.Input(
        "trigger",
        optional=True,
        tooltip=(
            "Any value (a LATENT, an IMAGE, ...). It is passed through unchanged; connecting it makes this node run "
            "after the node that produced it, and the node using the passthrough run after this one."
        ),
    )


def trigger_output() -> Any:
    """The passthrough of :func:`trigger_input`."""
    return surface.io.AnyType.Output("passthrough", display_name="trigger", tooltip="The trigger value, unchanged.")


class MoveToGPU(surface.io.ComfyNode):
    """Thin node: the move itself is ``bridge.moves.move`` over ``core.loading``."""

    @classmethod
    def define_schema(cls) -> Any:
        io = surface.io
        return io.Schema(
            node_id="DeviceControl_MoveToGPU",
            display_name="Move To GPU",
            category="Device Control",
            description=(
                "Moves a model (MODEL, CLIP, VAE, ControlNet, CLIP vision, upscale model, model patch, GLIGEN) to a "
                "GPU now, keeping as much of it resident as the VRAM budget allows; the rest stays in RAM and "
                "streams layer by layer when it runs. The weights move in place: nothing is read from disk again, "
                "LoRAs are kept, and later nodes (KSampler, CLIP Text Encode, VAE Decode) keep the placement instead "
                "of loading the model their own way. The dtype stays, except that a diffusion model loaded with "
                "dtype auto takes ComfyUI's dtype for the new device (fp16 on a GPU). Cached like any node: the "
                "placement belongs to the model, so after an Offload To CPU the next node that computes with it "
                "loads it back here, under this budget, without this node running again."
            ),
            inputs=[
                model_input(),
                io.Combo.Input(
                    "device",
                    options=device_options(),
                    default="auto",
                    tooltip=device_tooltip(
                        "Where the model computes: gpu:N, auto (ComfyUI's GPU) or cpu. A device this machine does not "
                        "have falls back to auto with a warning, so workflows from other machines still run."
                    ),
                ),
                io.String.Input(
                    "vram_budget",
                    default="all",
                    tooltip=(
                        "How much of the device the model may take: 'all', a size such as '6GB' or '1.5 GiB', or a "
                        "share such as '50%'. Less than the model streams the rest from RAM (slower, never wrong)."
                    ),
                ),
                io.Boolean.Input(
                    "keep_resident",
                    default=False,
                    tooltip=(
                        "Keep it on the device when ComfyUI needs room for another model (that one streams instead). "
                        "Only Offload To CPU, or another Move To GPU without this, takes it off."
                    ),
                ),
                trigger_input(),
            ],
            hidden=[io.Hidden.unique_id],
            outputs=[
                model_output(),
                trigger_output(),
                io.String.Output("summary", display_name="summary", tooltip="What was moved where, and what streams."),
            ],
        )

    @classmethod
    def validate_inputs(cls, device: str | None, vram_budget: str | None) -> bool | str:
        # Checked when the prompt is queued, before anything loads. ComfyUI files a refusal under every input
        # this method takes, so the message names the input at fault. A device this machine lacks is not an
        # error: it falls back at run time, and the user is warned now. A linked budget (None here) is checked
        # when the node runs.
        try:
            if device is not None:
                parse_device_spec(device)
            if vram_budget is not None:
                Budget.parse(vram_budget)
        except InvalidDeviceSpecError as exc:
            return f"device: {exc}"
        except InvalidSizeError as exc:
            return f"vram_budget: {exc}"
        if device is not None:
            warn_missing_devices("Move To GPU", cls.hidden.unique_id if cls.hidden else None, device=device)
        return True

    @classmethod
    def execute(cls, model: Any, device: str, vram_budget: str, keep_resident: bool, trigger: Any = None) -> Any:
        return placed_output(cls, move(model, device, vram_budget, keep_resident, inventory), trigger)


def placed_output(node: type, result: MoveResult, trigger: Any) -> Any:
    """The outputs of placing node ``node`` (the class ComfyUI runs): the model, the trigger, the summary, also shown
    on the node; the panel is told, and the node remembers the model (its text when it comes from the cache)."""
    panel.announce()
    remember(node, (result.value,))
    return surface.io.NodeOutput(result.value, trigger, result.text, ui={"text": (result.text,)})
