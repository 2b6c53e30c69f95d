"""Load VAE With Device: a VAE file as a VAE, on the device and in the dtype chosen.

The node reads the header first (what the file is, its size), refuses a file that is not a VAE and a dtype a VAE
cannot have, checks RAM before reading a byte of weights, then builds the VAE with ComfyUI's classes, as ComfyUI's
Load VAE does, and streams the weights in (``bridge.vae``). The VAE decodes and encodes on the device chosen.
"""

from __future__ import annotations

from typing import Any

from ..core.detection.detect import Detection, detect_header
from ..core.detection.headers import read_header
from ..core.placement.fit import Choice, FitPlan
from ..core.units import format_bytes
from . import surface
from .bridge.vae import build_vae
from .model_files import (
    model_path,
    require_kind,
)
from .placing import (
    VAE_DTYPES,
    check_devices,
    device_input,
    dtype_input,
    loaded,
    plan_load,
    progress_bar,
    resolve_placement,
    summary_output,
    vae_dtype_problem,
)
from .state import inventory

ROLE = "vae"


class LoadVAEWithDevice(surface.io.ComfyNode):
    """Thin node: detection, fit and building live in ``core`` and ``bridge``."""

    @classmethod
    def define_schema(cls) -> Any:
        io = surface.io
        return io.Schema(
            node_id="DeviceControl_LoadVAE",
            display_name="Load VAE With Device",
            category="Device Control",
            description=(
                "Loads a VAE file on the device and in the dtype you choose, as ComfyUI's Load VAE builds it; it "
                "decodes and encodes there. Reads the file header first: what the file is and its size are known "
                "before any weight is read."
            ),
            inputs=[
                io.Combo.Input(
                    "vae_name",
                    options=surface.folder_paths().get_filename_list("vae"),
                    tooltip="The VAE file (from ComfyUI's vae folders).",
                ),
                device_input("device", "VAE"),
                dtype_input("dtype", "VAE (a VAE has no fp8)", VAE_DTYPES),
            ],
            hidden=[io.Hidden.unique_id],
            outputs=[io.Vae.Output(tooltip="The VAE, for VAE Decode / Encode."), summary_output()],
        )

    @classmethod
    def validate_inputs(cls, device: str, dtype: str) -> bool | str:
        # Taking ``dtype`` here makes ComfyUI leave its check to us, so an fp8 dtype (a workflow written for
        # another loader) is told why, not only that it is not in the list.
        if dtype not in VAE_DTYPES:
            return f"dtype: {vae_dtype_problem(dtype, 'dtype')}"
        return check_devices("Load VAE With Device", cls, device=device)

    @classmethod
    def execute(cls, vae_name: str, device: str, dtype: str) -> Any:
        path = model_path("vae", vae_name, "VAE", "vae_name")
        header = read_header(path)
        detection = detect_header(header)
        require_kind(vae_name, detection, ROLE, "VAE", "Load VAE")
        notes: list[str] = []
        place, choice = resolve_placement(ROLE, device, dtype, detection, inventory.snapshot(), notes)
        plan = plan_load(vae_name, detection.components, {ROLE: choice}, notes, cls)
        built = build_vae(header, place, progress_bar())
        return loaded(cls, _summary(vae_name, detection, choice, plan, built.vae, notes + built.notes), built.vae)


def _summary(name: str, detection: Detection, choice: Choice, plan: FitPlan, vae: Any, notes: list[str]) -> str:
    stored = str(vae.vae_dtype).replace("torch.", "")
    lines = [f"{detection.family} from {name}, as {type(vae.first_stage_model).__name__}"]
    lines += [
        f"  vae: decodes on {choice.device.id} ({choice.device.name}), {stored}: {format_bytes(part.bytes)} planned"
        for part in plan.components
    ]
    lines += [f"  fit on {d.device}: {d.verdict}" for d in plan.devices]
    lines += [f"  warning: {note}" for note in notes]
    return "\n".join(lines)
