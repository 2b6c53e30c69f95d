"""Load Diffusion Model With Device: a diffusion-model file (a UNet or DiT saved on its own, as Flux, SD3.5, Wan
and Qwen-Image ship) as a MODEL, on the device and in the dtype chosen.

The node reads the header first (family, size per dtype), plans the fit, refuses what is not a diffusion model or
cannot fit in RAM before reading a byte of weights, then builds the model with ComfyUI's classes, as ComfyUI's
Load Diffusion Model does, and streams the weights into place (``bridge.diffusion_model``).
"""

from __future__ import annotations

from typing import Any

from ..core.detection.detect import Detection, detect_header
from ..core.detection.headers import read_header
from ..core.placement.fit import Choice, FitPlan
from ..core.units import format_bytes
from . import surface
from .bridge.diffusion_model import build_diffusion_model
from .bridge.storage import dominant_storage
from .model_files import (
    detection_for_this_comfyui,
    gguf_blocks,
    model_files,
    model_path,
    require_kind,
)
from .placing import (
    DTYPES,
    check_devices,
    device_input,
    dtype_input,
    loaded,
    plan_load,
    progress_bar,
    resolve_placement,
    summary_output,
    with_fit,
)
from .state import inventory

ROLE = "diffusion_model"
#: ComfyUI's fp8_e4m3fn_fast: stored in fp8_e4m3fn, multiplied in fp8 where the device can.
FAST_FP8 = "fp8_e4m3fn_fast"


class LoadDiffusionModelWithDevice(surface.io.ComfyNode):
    """Thin node: detection, fit and building live in ``core`` and ``bridge``."""

    @classmethod
    def define_schema(cls) -> Any:
        io = surface.io
        return io.Schema(
            node_id="DeviceControl_LoadDiffusionModel",
            display_name="Load Diffusion Model With Device",
            category="Device Control",
            description=(
                "Loads a diffusion model saved on its own (Flux, SD3.5, Wan, Qwen-Image ... from the diffusion_models "
                "folder) on the device and in the dtype you choose, as ComfyUI's Load Diffusion Model builds it. Reads "
                "the file header first: family, size and whether it fits are known before any weight is read; "
                "weights stream straight into place."
            ),
            inputs=[
                io.Combo.Input(
                    "unet_name",
                    options=model_files("diffusion_models", gguf=True),
                    tooltip=(
                        "The diffusion model file (from ComfyUI's diffusion_models folders, unet included): "
                        "safetensors, or GGUF (kept quantised, dequantised layer by layer as it computes)."
                    ),
                ),
                device_input("device", "diffusion model"),
                dtype_input(
                    "dtype",
                    "diffusion model (fp8_e4m3fn_fast also multiplies in fp8 where the device can)",
                    [*DTYPES, FAST_FP8],
                ),
            ],
            hidden=[io.Hidden.unique_id],
            outputs=[
                io.Model.Output(tooltip="The diffusion model, for KSampler, LoRA loaders, Move To GPU and the like."),
                summary_output(),
            ],
        )

    @classmethod
    def validate_inputs(cls, device: str) -> bool | str:
        return check_devices("Load Diffusion Model With Device", cls, device=device)

    @classmethod
    def execute(cls, unet_name: str, device: str, dtype: str) -> Any:
        path = model_path("diffusion_models", unet_name, "diffusion model", "unet_name")
        header = read_header(path, gguf=True)
        detection = detection_for_this_comfyui(header, detect_header(header))
        require_kind(unet_name, detection, ROLE, "diffusion model", "Load Diffusion Model")
        notes: list[str] = []
        fast = dtype == FAST_FP8
        place, choice = resolve_placement(
            ROLE, device, "fp8_e4m3fn" if fast else dtype, detection, inventory.snapshot(), notes
        )
        plan = plan_load(unet_name, detection.components, {ROLE: choice}, notes, cls)
        built = build_diffusion_model(
            header, detection, with_fit(place, plan, choice), fp8_optimizations=fast, progress=progress_bar()
        )
        return loaded(cls, _summary(unet_name, detection, choice, plan, built.model, notes + built.notes), built.model)


def _summary(name: str, detection: Detection, choice: Choice, plan: FitPlan, model: Any, notes: list[str]) -> str:
    inner = model.model
    cast = getattr(inner, "manual_cast_dtype", None)
    stored = str(dominant_storage(inner.diffusion_model))
    computes = f" (computes in {str(cast).replace('torch.', '')})" if cast is not None else ""
    blocks = gguf_blocks(detection)
    if blocks is not None:  # kept in the file's blocks, dequantised layer by layer as it computes
        stored = blocks
        computes = f" (computes in {str(cast or inner.get_dtype()).replace('torch.', '')})"
    lines = [f"{detection.family} ({detection.comfy_class}, {detection.model_type}) from {name}"]
    lines += [
        f"  diffusion model: {choice.device.id} ({choice.device.name}), {stored}{computes}: "
        f"{format_bytes(part.bytes)} planned"
        for part in plan.components
    ]
    lines += [f"  fit on {d.device}: {d.verdict}" for d in plan.devices]
    lines += [f"  warning: {note}" for note in notes]
    return "\n".join(lines)
