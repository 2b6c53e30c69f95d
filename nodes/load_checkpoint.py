"""Load Checkpoint With Device: a checkpoint's MODEL, CLIP and VAE, each on the device and in the dtype chosen.

The node reads the header first (family, components, sizes), plans the fit, refuses what cannot fit in RAM
before reading a byte of weights, then builds the models with ComfyUI's classes and streams the weights in
(``bridge.checkpoint``). A device the machine lacks falls back to ComfyUI's default, with a warning in the
node's output, so shared workflows still run.
"""

from __future__ import annotations

from typing import Any

from ..core.detection.detect import Detection, detect_header
from ..core.detection.headers import read_header
from ..core.placement.fit import Choice, FitPlan
from ..core.units import format_bytes
from . import surface
from .bridge.checkpoint import BuiltCheckpoint, build_checkpoint, built_dtypes
from .model_files import (
    detection_for_this_comfyui,
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
    with_fit,
)
from .state import inventory

ROLES = (("diffusion_model", "model"), ("text_encoder", "clip"), ("vae", "vae"))


class LoadCheckpointWithDevice(surface.io.ComfyNode):
    """Thin node: detection, fit and building live in ``core`` and ``bridge``."""

    @classmethod
    def define_schema(cls) -> Any:
        io = surface.io
        return io.Schema(
            node_id="DeviceControl_LoadCheckpoint",
            display_name="Load Checkpoint With Device",
            category="Device Control",
            description=(
                "Loads a checkpoint with the diffusion model, the text encoder and the VAE each on the device and in "
                "the dtype you choose. Reads the file header first: family, sizes and whether it fits are known before "
                "any weight is read; weights stream straight into place, so RAM peaks near what stays resident."
            ),
            inputs=[
                io.Combo.Input(
                    "ckpt_name",
                    options=surface.folder_paths().get_filename_list("checkpoints"),
                    tooltip="The checkpoint file (from ComfyUI's checkpoints folders).",
                ),
                device_input("model_device", "diffusion model (UNet/DiT)"),
                device_input("clip_device", "text encoder(s)"),
                device_input("vae_device", "VAE"),
                dtype_input("model_dtype", "diffusion model"),
                dtype_input("clip_dtype", "text encoder(s)"),
                dtype_input("vae_dtype", "VAE (a VAE has no fp8)", VAE_DTYPES),
            ],
            hidden=[io.Hidden.unique_id],
            outputs=[
                io.Model.Output(tooltip="The diffusion model, for KSampler, LoRA loaders and the like."),
                io.Clip.Output(tooltip="The text encoder(s), for CLIP Text Encode."),
                io.Vae.Output(tooltip="The VAE, for VAE Decode / Encode."),
                summary_output(),
            ],
        )

    @classmethod
    def validate_inputs(cls, model_device: str, clip_device: str, vae_device: str, vae_dtype: str) -> bool | str:
        # Taking ``vae_dtype`` makes ComfyUI leave its check to us: an fp8 VAE (a workflow saved before the list
        # offered only what a VAE takes) is told why when queued, not only that it is not in the list.
        if vae_dtype not in VAE_DTYPES:
            return f"vae_dtype: {vae_dtype_problem(vae_dtype, 'vae_dtype')}"
        return check_devices(
            "Load Checkpoint With Device",
            cls,
            model_device=model_device,
            clip_device=clip_device,
            vae_device=vae_device,
        )

    @classmethod
    def execute(
        cls,
        ckpt_name: str,
        model_device: str,
        clip_device: str,
        vae_device: str,
        model_dtype: str,
        clip_dtype: str,
        vae_dtype: str,
    ) -> Any:
        path = model_path("checkpoints", ckpt_name, "checkpoint", "ckpt_name")
        header = read_header(path)
        detection = detection_for_this_comfyui(header, detect_header(header))
        require_kind(ckpt_name, detection, "checkpoint", "checkpoint with text encoder and VAE", "Load Checkpoint")
        snapshot = inventory.snapshot()
        notes: list[str] = []
        placements, choices = {}, {}
        for (role, _), device, dtype in zip(
            ROLES, (model_device, clip_device, vae_device), (model_dtype, clip_dtype, vae_dtype), strict=True
        ):
            placements[role], choices[role] = resolve_placement(role, device, dtype, detection, snapshot, notes)
            if choices[role].dtype == "fp8" and "fp8" not in choices[role].device.dtypes:
                notes.append(
                    f"{role.replace('_', ' ')}: {choices[role].device.id} does not compute in fp8; the "
                    "weights stay fp8 in memory and are cast to a dtype it computes in, layer by layer"
                )
        plan = plan_load(ckpt_name, detection.components, choices, notes, cls)
        placements = {role: with_fit(p, plan, choices[role]) for role, p in placements.items()}
        built = build_checkpoint(header, detection, placements, progress_bar())
        summary = _summary(ckpt_name, detection, choices, plan, built, notes)
        return loaded(cls, summary, built.model, built.clip, built.vae)


def _summary(
    name: str, detection: Detection, choices: dict[str, Choice], plan: FitPlan, built: BuiltCheckpoint, notes: list[str]
) -> str:
    dtypes = built_dtypes(built)
    lines = [f"{detection.family} ({detection.comfy_class}, {detection.model_type}) from {name}"]
    for component in plan.components:
        role = component.component.split(":")[0]
        choice = choices[role]
        label = component.component.replace("_", " ").replace(":", " ")
        lines.append(
            f"  {label}: {choice.device.id} ({choice.device.name}), {dtypes[role]}: "
            f"{format_bytes(component.bytes)} planned"
        )
    lines += [f"  fit on {d.device}: {d.verdict}" for d in plan.devices]
    lines += [f"  warning: {note}" for note in notes + built.notes]
    return "\n".join(lines)
