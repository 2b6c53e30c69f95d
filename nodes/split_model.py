"""Split Model Across Devices: one diffusion model or text encoder over several GPUs (and the CPU), for models larger
than any one."""

from __future__ import annotations

from typing import Any

from ..core.errors import InvalidAllocationError
from ..core.placement.allocation import parse_allocation
from . import surface
from .bridge.split_moves import split_model
from .move_to_gpu import placed_output, trigger_input, trigger_output
from .state import inventory


class SplitModel(surface.io.ComfyNode):
    """Thin node: the split itself is ``bridge.split_moves.split_model`` over ``core.placement``."""

    @classmethod
    def define_schema(cls) -> Any:
        io = surface.io
        return io.Schema(
            node_id="DeviceControl_SplitModel",
            display_name="Split Model Across Devices",
            category="Device Control",
            description=(
                "Shares one diffusion model (MODEL) or text encoder (CLIP) out over several devices, in whole "
                "blocks and in model order, so a model larger than any one GPU runs. pipeline: each block computes "
                "on the device that holds it and only activations cross between devices. stream: the first device "
                "computes and the others hold the rest, streamed to it ahead of use. Cached like any node: the split "
                "belongs to the model and holds whenever it next computes."
            ),
            inputs=[
                io.MultiType.Input(
                    "model",
                    types=[io.Model, io.Clip],
                    tooltip=(
                        "The diffusion model (MODEL) or the text encoders (CLIP) from any loader. A VAE cannot be "
                        "connected: it is not split (Move To GPU puts it on one device)."
                    ),
                ),
                io.String.Input(
                    "allocation",
                    default="auto",
                    tooltip=(
                        "Which device holds how much, in the order the model's blocks fill them: "
                        "'gpu:0=10GB, gpu:1=12GB, cpu=*' (sizes; '*' takes the rest), 'gpu:0=40%, gpu:1=60%' "
                        "(shares of the model) or 'auto' (devices in order of free memory, the rest in RAM). "
                        "A device this machine lacks is left out with a warning."
                    ),
                ),
                io.Combo.Input(
                    "mode",
                    options=["pipeline", "stream"],
                    default="pipeline",
                    tooltip=(
                        "pipeline: every block computes where it lives (several GPUs; weights never move). "
                        "stream: the first device computes, the others' blocks are copied to it ahead of use "
                        "(one GPU plus RAM or a small second GPU)."
                    ),
                ),
                trigger_input(),
            ],
            hidden=[io.Hidden.unique_id],
            outputs=[
                io.Custom("MODEL,CLIP").Output(
                    "split", display_name="model", tooltip="The same model (a clone carrying the split)."
                ),
                trigger_output(),
                io.String.Output(
                    "summary", display_name="summary", tooltip="Which blocks went where, bytes per device."
                ),
            ],
        )

    @classmethod
    def validate_inputs(cls, allocation: str | None) -> bool | str:
        # Checked when the prompt is queued, before anything loads (a linked allocation, None here, when it runs).
        try:
            if allocation is not None:
                parse_allocation(allocation)
        except InvalidAllocationError as exc:
            return str(exc)
        return True

    @classmethod
    def execute(cls, model: Any, allocation: str, mode: str, trigger: Any = None) -> Any:
        return placed_output(cls, split_model(model, allocation, mode, inventory), trigger)
