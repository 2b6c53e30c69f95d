"""Move To GPU: put a MODEL, CLIP or VAE on a device, under a VRAM budget, at this point of the graph."""

from __future__ import annotations

import logging
from typing import Any

from ..core.devices.inventory import parse_device_spec
from ..core.errors import InvalidDeviceSpecError
from . import panel, surface, surface_types
from .bridge.books import displacements
from .bridge.moves import MoveResult, move
from .state import device_options, inventory

log = logging.getLogger("device_control")

MODEL_TYPES = "the MODEL, CLIP or VAE"
#: The types the model input takes, as ComfyUI writes them (and the output's type where it cannot follow the input).
MODEL_IO_TYPE = "MODEL,CLIP,VAE"
MODEL_TOOLTIP = "A MODEL, CLIP or VAE from any loader (ComfyUI's own or Load Checkpoint With Device)."
MOVED_TOOLTIP = "The same model (a clone that carries the placement)."
#: Where the running ComfyUI's MatchType works: the template Move To GPU's model input and output share, so the
#: output's type is the input's (a CLIP in, a CLIP out). ``None``: the input takes the three and the output is
#: typed with all three.
MODEL_TEMPLATE = surface_types.match_template("model", [surface.io.Model, surface.io.Clip, surface.io.Vae])
#: The type each input of Move To GPU takes when linked, checked by the node where its model input follows a
#: template (ComfyUI's own check lets anything into it); the device and trigger take what their links give.
LINKED_TYPES = {"model": MODEL_IO_TYPE, "vram_budget": "STRING", "keep_resident": "BOOLEAN"}


def model_input(optional: bool = False) -> Any:
    """The input that takes a MODEL, a CLIP or a VAE."""
    io = surface.io
    return io.MultiType.Input("model", types=[io.Model, io.Clip, io.Vae], optional=optional, tooltip=MODEL_TOOLTIP)


def model_output() -> Any:
    """The output that gives back what came in, typed with all three (a MODEL, CLIP or VAE)."""
    return surface.io.Custom(MODEL_IO_TYPE).Output("moved", display_name="model", tooltip=MOVED_TOOLTIP)


def model_slots() -> tuple[Any, Any]:
    """Move To GPU's model input and output: joined by :data:`MODEL_TEMPLATE` where there is one, so the editor
    types the output as whatever is connected to the input; else :func:`model_input` and :func:`model_output`."""
    if MODEL_TEMPLATE is None:
        return model_input(), model_output()
    io = surface.io
    return (
        io.MatchType.Input(id="model", template=MODEL_TEMPLATE, tooltip=MODEL_TOOLTIP),
        io.MatchType.Output(id="moved", template=MODEL_TEMPLATE, display_name="model", tooltip=MOVED_TOOLTIP),
    )


def refused_links(input_types: dict[str, Any] | None) -> str | None:
    """What is wrong with the types linked to Move To GPU's inputs (``input_types``, as ComfyUI hands them to
    ``validate_inputs``), or ``None``."""
    wrong = [
        f"{name}: a {received} is linked where {LINKED_TYPES[name]} is taken; link an output of that type instead"
        for name, received in (input_types or {}).items()
        if name in LINKED_TYPES and not surface_types.link_fits(received, LINKED_TYPES[name])
    ]
    return "; ".join(wrong) or None


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
        model_in, model_out = model_slots()
        return io.Schema(
            node_id="DeviceControl_MoveToGPU",
            display_name="Move To GPU",
            category="Device Control",
            description=(
                "Moves a model (MODEL, CLIP or VAE) to a GPU now, keeping as much of it resident as the VRAM budget "
                "allows; the rest stays in RAM and streams layer by layer when it runs. The weights move in place: "
                "nothing is read from disk again, LoRAs are kept, and later nodes (KSampler, CLIP Text Encode, VAE "
                "Decode) keep the placement instead of loading the model their own way. The dtype stays, except that a "
                "diffusion model loaded with dtype auto takes ComfyUI's dtype for the new device (fp16 on a GPU)."
            ),
            inputs=[
                model_in,
                io.Combo.Input(
                    "device",
                    options=device_options(),
                    default="auto",
                    tooltip=(
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
            outputs=[
                model_out,
                trigger_output(),
                io.String.Output("summary", display_name="summary", tooltip="What was moved where, and what streams."),
            ],
        )

    @classmethod
    def check_device(cls, device: str) -> bool | str:
        # Only the device is validated here: ComfyUI reports a validation error against every input this
        # method takes, so the budget (checked first thing when the node runs, before anything moves) is not.
        # A device this machine lacks is not an error: it falls back at run time, with a warning.
        try:
            parse_device_spec(device)
        except InvalidDeviceSpecError as exc:
            return str(exc)
        return True

    @classmethod
    def check_device_and_links(cls, device: str, input_types: dict[str, Any] | None = None) -> bool | str:
        # Taking input_types turns ComfyUI's own check of linked types off for this node, so it is done here:
        # a LATENT linked to the model input is still refused when the prompt is queued.
        return refused_links(input_types) or cls.check_device(device)

    # Where the model input follows a template, ComfyUI lets any link into it: the node checks links itself.
    validate_inputs = check_device_and_links if MODEL_TEMPLATE is not None else check_device

    @classmethod
    def fingerprint_inputs(cls, **kwargs: Any) -> int:
        # Cached like any node while nothing has left a device since it ran; run again (and move again) once
        # something was offloaded or evicted, so the move still happens at this point of the graph.
        return displacements()

    @classmethod
    def execute(cls, model: Any, device: str, vram_budget: str, keep_resident: bool, trigger: Any = None) -> Any:
        return placed_output(move(model, device, vram_budget, keep_resident, inventory), trigger)


def placed_output(result: MoveResult, trigger: Any) -> Any:
    """A placing node's outputs (the model, the trigger, the summary, also shown on the node); the panel is told."""
    panel.announce()
    return surface.io.NodeOutput(result.value, trigger, result.text, ui={"text": (result.text,)})
