"""Offload To CPU: move models back to RAM at this point of the graph, and say what it freed."""

from __future__ import annotations

from typing import Any

from . import panel, surface
from .bridge.offloads import OFFLOAD_MODES, offload
from .move_to_gpu import model_input, trigger_input, trigger_output
from .state import inventory

#: A fresh node's mode: the one that needs no model connected.
DEFAULT_MODE = "all models"
#: The mode that reads ``free_amount``.
FREE_MODE = "free N GB"
DEFAULT_FREE_AMOUNT = "2GB"


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
                "that uses one loads it again where its placement says, without reading the file. Runs on every "
                "queue, even when nothing is connected to its outputs."
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
            is_output_node=True,
            not_idempotent=True,
        )

    @classmethod
    def fingerprint_inputs(cls, **kwargs: Any) -> float:
        return float("nan")  # never equal to itself: an offload is an action, done on every run

    @classmethod
    def execute(cls, mode: str, free_amount: str, empty_cache: bool, model: Any = None, trigger: Any = None) -> Any:
        text = offload(model, mode, free_amount, empty_cache, inventory)
        if mode != FREE_MODE and free_amount.strip() != DEFAULT_FREE_AMOUNT:
            text += f"\nfree_amount {free_amount!r} was not read: only mode '{FREE_MODE}' reads it."
        panel.announce()
        return surface.io.NodeOutput(trigger, text, ui={"text": (text,)})
