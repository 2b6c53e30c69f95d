"""Offload To CPU: move models back to RAM at this point of the graph, and say what it freed."""

from __future__ import annotations

from typing import Any

from ..core.errors import InvalidSizeError
from ..core.units import parse_size
from . import panel, surface
from .bridge.offloads import OFFLOAD_MODES, offload
from .device_warnings import warn
from .move_to_gpu import model_input, trigger_input, trigger_output
from .state import inventory

#: A fresh node's mode: the one that needs no model connected.
DEFAULT_MODE = "all models"
#: The mode that reads ``free_amount``.
FREE_MODE = "free N GB"
DEFAULT_FREE_AMOUNT = "2GB"
#: What ``validate_inputs`` receives for an optional input with nothing connected (a linked one gives ``None``).
UNWIRED = object()
#: The warning for an Offload To CPU wired after nothing.
UNWIRED_NOTE = (
    "nothing is connected to its model or trigger input, so ComfyUI may run it at any point of the graph, even "
    "first, before any model is loaded (it then frees 0 B). Connect the output of the node it must follow (a "
    "KSampler's LATENT, say) to its trigger."
)


class OffloadToCPU(surface.io.ComfyNode):
    """Thin node: the unloading is ``bridge.offloads.offload`` over ComfyUI's own list of loaded models."""

    @classmethod
    def define_schema(cls) -> Any:
        io = surface.io
        return io.Schema(
            node_id="DeviceControl_OffloadToCPU",
            display_name="Offload To CPU",
            category="Device Control",
            description=(
                "Moves models from their GPU back to RAM now, without unloading them from ComfyUI: the next node "
                "that uses one loads it again where its placement says, without reading the file. Runs even when "
                "nothing is connected to its outputs. Cached like any node: queued again unchanged, the prompt runs "
                "nothing, so this node frees nothing more (what it freed stays freed until a node that ran after it "
                "loaded a model again); it runs again when a node before it does. Wire its trigger after the node "
                "it must follow: with nothing connected it may run first and free nothing."
            ),
            inputs=[
                model_input(optional=True),
                io.Combo.Input(
                    "mode",
                    options=list(OFFLOAD_MODES),
                    default=DEFAULT_MODE,
                    tooltip=(
                        "all models (the default, needs nothing connected): every loaded model. full: the connected "
                        "model entirely. free N GB: free_amount from the connected model (or, with none connected, "
                        "from the least recently used models). all except this one: every model but the connected "
                        "one. Models kept resident are offloaded too: you asked."
                    ),
                ),
                io.String.Input(
                    "free_amount",
                    default=DEFAULT_FREE_AMOUNT,
                    tooltip="Read in mode 'free N GB' only (the other modes ignore it): how much to free, "
                    "such as '2GB' or '512MiB'.",
                ),
                io.Boolean.Input(
                    "empty_cache",
                    default=True,
                    tooltip="Give the memory the GPU allocator keeps cached back to the device afterwards.",
                ),
                trigger_input(),
            ],
            outputs=[
                trigger_output(),
                io.String.Output("summary", display_name="summary", tooltip="What was freed, per device and model."),
            ],
            hidden=[io.Hidden.unique_id],
            is_output_node=True,
            not_idempotent=True,
        )

    @classmethod
    def validate_inputs(cls, free_amount: str | None, model: Any = UNWIRED, trigger: Any = UNWIRED) -> bool | str:
        # Checked when the prompt is queued, before anything loads; in every mode (a size that cannot be read is
        # a typo, whichever mode reads it). A linked input is None here (its value is not known yet); one with
        # nothing connected keeps the default, UNWIRED. ComfyUI files a refusal under every input this method
        # takes that has a value or a link, so the message names the input at fault.
        if free_amount is not None:
            try:
                parse_size(free_amount)
            except InvalidSizeError as exc:
                return f"free_amount: {exc} It is how much mode '{FREE_MODE}' frees."
        if model is UNWIRED and trigger is UNWIRED:
            warn("Offload To CPU", cls.hidden.unique_id if cls.hidden else None, UNWIRED_NOTE)
        return True

    @classmethod
    def execute(cls, mode: str, free_amount: str, empty_cache: bool, model: Any = None, trigger: Any = None) -> Any:
        text = offload(model, mode, free_amount, empty_cache, inventory)
        if mode != FREE_MODE and free_amount.strip() != DEFAULT_FREE_AMOUNT:
            text += f"\nfree_amount {free_amount!r} was not read: only mode '{FREE_MODE}' reads it."
        if model is None and trigger is None:
            text += f"\nwarning: {UNWIRED_NOTE}"
        panel.announce()
        return surface.io.NodeOutput(trigger, text, ui={"text": (text,)})
