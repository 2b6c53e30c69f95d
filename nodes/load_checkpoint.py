"""Load Checkpoint With Device: a checkpoint's MODEL, CLIP and VAE, each on the device and in the dtype chosen.

The node reads the header first (family, components, sizes), plans the fit, refuses what cannot fit in RAM
before reading a byte of weights, then builds the models with ComfyUI's classes and streams the weights in
(``bridge.checkpoint``). A device the machine lacks falls back to ComfyUI's default, with a warning in the
node's output, so shared workflows still run.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch

from ..core.detection.detect import Detection, detect_header
from ..core.detection.headers import FileHeader, read_header
from ..core.devices.backends import DeviceInfo, backend_of
from ..core.devices.inventory import InventorySnapshot, parse_device_spec
from ..core.errors import (
    DeviceControlError,
    DeviceNotFoundError,
    InvalidDeviceSpecError,
    ModelFileError,
    UnknownModelError,
)
from ..core.placement.budget import Placement
from ..core.placement.fit import Choice, FitPlan, plan_fit
from ..core.units import format_bytes
from . import panel, surface
from .bridge import device_id
from .bridge.checkpoint import BuiltCheckpoint, ComponentPlan, build_checkpoint, built_dtypes, default_dtype
from .bridge.comfy_detection import detect_with_comfyui
from .state import device_options, inventory

log = logging.getLogger("device_control")

ROLES = (("diffusion_model", "model"), ("text_encoder", "clip"), ("vae", "vae"))
DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
_CANDIDATE = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e5m2: "fp8",
}


def _comfy_default_device(role: str) -> torch.device:
    mm = surface.model_management()
    return {"diffusion_model": mm.get_torch_device, "text_encoder": mm.text_encoder_device, "vae": mm.vae_device}[
        role
    ]()


def _chosen_device(
    role: str, spec: str, snapshot: InventorySnapshot, notes: list[str]
) -> tuple[DeviceInfo, torch.device, bool]:
    """The device for ``role``, its torch device, and whether the user chose it (``auto`` and a device this
    machine lacks leave the choice to ComfyUI; the latter says so in ``notes``)."""
    if spec.strip().lower() != "auto":
        try:
            info = inventory.resolve(spec, snapshot=snapshot).device
            return info, torch.device(info.torch_device or "cpu"), True
        except DeviceNotFoundError as exc:  # a workflow from another machine: run anyway, and say so
            what = role.replace("_", " ")
            notes.append(f"{what}: {str(exc).split('; pick')[0]}; using auto (ComfyUI's choice) instead")
    torch_device = _comfy_default_device(role)
    return snapshot.get(device_id(torch_device, snapshot)) or snapshot.get("cpu"), torch_device, False


def _storage_dtype(role: str, name: str) -> torch.dtype | None:
    dtype = DTYPES[name]
    if role == "vae" and dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise DeviceControlError(
            "the VAE cannot be stored in fp8: ComfyUI's VAE has no cast path; "
            "choose fp32, fp16, bf16 or auto for vae_dtype."
        )
    return dtype


def resolve_placement(
    role: str, spec: str, dtype_name: str, detection: Detection, snapshot: InventorySnapshot, notes: list[str]
) -> tuple[ComponentPlan, Choice]:
    """Turn the node's device and dtype choice for one role into a placement and a fit-plan choice."""
    info, torch_device, chosen = _chosen_device(role, spec, snapshot, notes)
    dtype = _storage_dtype(role, dtype_name)
    target = inventory.target(info.id, snapshot) if chosen and info.id else torch_device
    compute = backend_of(target).comfy_device(target)  # the host, for a device ComfyUI does not know
    # The user chose this device: the placement goes with the model. (auto: ComfyUI decides, as its loader does.)
    managed = Placement(target, device_id=info.id) if chosen and info.id else None
    place = ComponentPlan(compute, target, dtype, placement=managed)
    return place, Choice(info, _CANDIDATE[dtype or default_dtype(role, compute, detection)])


class LoadCheckpointWithDevice(surface.io.ComfyNode):
    """Thin node: detection, fit and building live in ``core`` and ``bridge``."""

    @classmethod
    def define_schema(cls) -> Any:
        io = surface.io
        devices = device_options()
        dtypes = list(DTYPES)

        def device_input(name: str, what: str) -> Any:
            return io.Combo.Input(
                name,
                options=devices,
                default="auto",
                tooltip=(
                    f"Where the {what} lives: auto (ComfyUI's choice), cpu, or gpu:N. A device this machine does not "
                    "have falls back to auto with a warning, so workflows from other machines still run."
                ),
            )

        def dtype_input(name: str, what: str) -> Any:
            return io.Combo.Input(
                name,
                options=dtypes,
                default="auto",
                tooltip=(
                    f"Storage dtype of the {what}: auto (ComfyUI's choice for the device), fp32, fp16, bf16 or fp8. "
                    "When the device cannot compute in it, weights are cast on the fly to a dtype it can."
                ),
            )

        return io.Schema(
            node_id="DeviceControl_LoadCheckpoint",
            display_name="Load Checkpoint With Device",
            category="device_control",
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
                dtype_input("vae_dtype", "VAE (fp8 is not possible for a VAE)"),
            ],
            outputs=[
                io.Model.Output(tooltip="The diffusion model, for KSampler, LoRA loaders and the like."),
                io.Clip.Output(tooltip="The text encoder(s), for CLIP Text Encode."),
                io.Vae.Output(tooltip="The VAE, for VAE Decode / Encode."),
                io.String.Output(
                    display_name="summary", tooltip="What was loaded where, in which dtype, and whether it fits."
                ),
            ],
        )

    @classmethod
    def validate_inputs(cls, model_device: str, clip_device: str, vae_device: str) -> bool | str:
        for name, value in (("model_device", model_device), ("clip_device", clip_device), ("vae_device", vae_device)):
            try:
                parse_device_spec(value)
            except InvalidDeviceSpecError as exc:
                return f"{name}: {exc}"
        return True  # a device this machine lacks is not an error: it falls back at run time, with a warning

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
        path = _checkpoint_path(ckpt_name)
        header = read_header(path)
        detection = detection_for_this_comfyui(header, detect_header(header))
        _require_checkpoint(ckpt_name, detection)
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
        plan = plan_fit(detection.components, choices)
        _require_ram(ckpt_name, plan)
        fits = {d.device: d.fits for d in plan.devices}
        placements = {role: _with_fit(p, fits.get(choices[role].device.id, True)) for role, p in placements.items()}
        for note in notes:
            log.warning("[Device Control] %s: %s", ckpt_name, note)
        built = build_checkpoint(header, detection, placements, _progress())
        panel.announce()
        summary = _summary(ckpt_name, detection, choices, plan, built, notes)
        log.info("[Device Control] %s", summary)
        return surface.io.NodeOutput(built.model, built.clip, built.vae, summary, ui={"text": (summary,)})


def detection_for_this_comfyui(header: FileHeader, detection: Detection) -> Detection:
    """Our detection, or the running ComfyUI's own where ours names no class it builds.

    Our table follows the newest ComfyUI tested: a file it does not know may be of a family the user's ComfyUI
    knows (a newer one), and a class it names may be newer than the user's ComfyUI (which then builds the file as
    an older class, or not at all). Either way, what ComfyUI will build is what it detects.
    """
    if detection.kind == "unknown" or (
        detection.comfy_class is not None and not surface.has_model_class(detection.comfy_class)
    ):
        return detect_with_comfyui(header) or detection
    return detection


def _with_fit(place: ComponentPlan, fits: bool) -> ComponentPlan:
    return dataclasses.replace(place, fits=fits)


def _require_checkpoint(name: str, detection: Detection) -> None:
    if detection.kind == "unknown":
        closest = "; ".join(detection.candidates[:3])
        raise UnknownModelError(
            f"{name} is not a model family ComfyUI can build (neither our header rules nor ComfyUI's own "
            f"detection recognise it): {detection.reason}."
            + (f" Closest: {closest}." if closest else "")
            + " Check that the file is a complete checkpoint."
        )
    if "mixed-precision quantized layers" in detection.variants:
        raise DeviceControlError(
            f"{name} stores some layers in ComfyUI's mixed-precision quantized format, whose weights ComfyUI "
            "builds while reading them; Device Control cannot stream those yet. Load it with ComfyUI's Load "
            "Checkpoint."
        )
    if detection.kind != "checkpoint":
        raise DeviceControlError(
            f"{name} is a {detection.kind.replace('_', ' ')} ({detection.family}), not a full checkpoint with text "
            "encoder and VAE; load it with the matching ComfyUI loader (Load Diffusion Model, Load VAE, Load CLIP "
            "or Load LoRA)."
        )


def _checkpoint_path(ckpt_name: str) -> str:
    """The file ``ckpt_name`` names now; a clear error if it left the folder after the prompt was queued."""
    path = surface.folder_paths().get_full_path("checkpoints", ckpt_name)
    if path is None or not os.path.isfile(path):
        raise ModelFileError(
            f"checkpoint {ckpt_name!r} is not in the checkpoints folder any more (deleted or moved after the "
            "prompt was queued). Put it back, or choose another in ckpt_name, and queue the prompt again."
        )
    return path


def _require_ram(name: str, plan: FitPlan) -> None:
    host = next((d for d in plan.devices if d.device == "cpu"), None)
    if host is not None and not host.fits:
        raise DeviceControlError(
            f"{name} does not fit: {host.verdict}. Nothing was read. Choose a smaller dtype (fp16 or fp8) for the "
            "largest component, put it on a GPU, or close programs that use RAM."
        )


def _progress() -> Any:
    mm = surface.model_management()
    bar = surface.comfy_utils().ProgressBar(1000)

    def report(done: int, total: int) -> None:
        mm.throw_exception_if_processing_interrupted()  # Cancel stops the load between two tensors
        bar.update_absolute(int(1000 * done / max(total, 1)), 1000)

    return report


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
