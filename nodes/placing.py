"""What the loader nodes share: a device and dtype choice turned into a placement, the detection the running
ComfyUI will build from, the RAM check before anything is read, the file's path, and the progress bar.

A device the machine lacks falls back to ComfyUI's default, with a note in the node's output, so shared workflows
still run.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch

from ..core.detection.detect import LLAMA_CPP_NAMED, Detection
from ..core.detection.headers import FileHeader
from ..core.devices.backends import DeviceInfo, backend_of
from ..core.devices.inventory import InventorySnapshot, parse_device_spec
from ..core.errors import (
    DeviceControlError,
    InvalidDeviceSpecError,
    ModelFileError,
    UnknownModelError,
)
from ..core.placement.budget import Placement
from ..core.placement.fit import Choice, FitPlan, plan_fit
from ..core.units import format_bytes
from . import panel, surface
from .bridge import device_id
from .bridge.checkpoint import default_dtype
from .bridge.comfy_detection import detect_with_comfyui
from .bridge.fallback import resolve_or_fallback
from .bridge.filling import ComponentPlan
from .cached_texts import remember
from .device_warnings import warn_missing_devices
from .state import device_options, device_tooltip, inventory

log = logging.getLogger("device_control")

#: Storage dtypes a loader offers, by the name the node shows.
DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
#: Storage dtypes a VAE can have (ComfyUI's VAE has no cast path for fp8).
VAE_DTYPES = ("auto", "fp32", "fp16", "bf16")
#: The node that loads a file of each kind.
LOADER_FOR = {
    "checkpoint": "Load Checkpoint With Device",
    "diffusion_model": "Load Diffusion Model With Device",
    "text_encoder": "Load Text Encoders With Device",
    "vae": "Load VAE With Device",
    "lora": "a LoRA loader (Load LoRA)",
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
    machine lacks leave the choice to ComfyUI; the latter says so in ``notes``, as Move To GPU does)."""
    if spec.strip().lower() != "auto":
        info, warning = resolve_or_fallback(inventory, spec, snapshot)
        if info is not None:
            return info, torch.device(info.torch_device or "cpu"), True
        notes.append(f"{role.replace('_', ' ')}: {warning}")  # a workflow from another machine: run anyway
    torch_device = _comfy_default_device(role)
    return snapshot.get(device_id(torch_device, snapshot)) or snapshot.get("cpu"), torch_device, False


def _storage_dtype(role: str, name: str) -> torch.dtype | None:
    if role == "vae" and name not in VAE_DTYPES:
        raise DeviceControlError(vae_dtype_problem(name, "vae_dtype"))
    return DTYPES[name]


def vae_dtype_problem(name: str, option: str) -> str:
    """What is wrong with ``name`` as a VAE's storage dtype (given in the node's input ``option``)."""
    return (
        f"the VAE cannot be stored in {name}: ComfyUI's VAE has no cast path for it; choose "
        f"{', '.join(VAE_DTYPES[1:])} or auto for {option}."
    )


def device_input(name: str, what: str) -> Any:
    """A node's device choice for ``what``: ``auto``, ``cpu`` and every accelerator of this machine."""
    return surface.io.Combo.Input(
        name,
        options=device_options(),
        default="auto",
        tooltip=device_tooltip(
            f"Where the {what} lives: auto (ComfyUI's choice), cpu, or gpu:N. A device this machine does not "
            "have falls back to auto with a warning, so workflows from other machines still run."
        ),
    )


def dtype_input(name: str, what: str, options: list[str] | tuple[str, ...] = tuple(DTYPES)) -> Any:
    """A node's storage dtype choice for ``what``."""
    return surface.io.Combo.Input(
        name,
        options=list(options),
        default="auto",
        tooltip=(
            f"Storage dtype of the {what}: auto (ComfyUI's choice for the device), "
            f"{', '.join(o for o in options if o != 'auto')}. When the device cannot compute in it, weights are "
            "cast on the fly to a dtype it can."
        ),
    )


def check_devices(title: str, node: type, **inputs: str | None) -> bool | str:
    """A node's ``validate_inputs`` answer for its device inputs (by name), when the prompt is queued: a malformed
    one is refused; one this machine lacks is not an error (it falls back at run time) but a warning the user sees
    now (``device_warnings``), from node ``node`` (the class ComfyUI validates, shown as ``title``). A linked
    device (None) is checked when the node runs."""
    given = {name: value for name, value in inputs.items() if value is not None}
    for name, value in given.items():
        try:
            parse_device_spec(value)
        except InvalidDeviceSpecError as exc:
            return f"{name}: {exc}"
    hidden = getattr(node, "hidden", None)
    warn_missing_devices(title, getattr(hidden, "unique_id", None), **given)
    return True


def plan_load(
    name: str, components: Any, choices: dict[str, Choice], notes: list[str], node: type | None = None
) -> FitPlan:
    """The fit plan of a load, refused (before anything is read) when RAM cannot hold it; ``notes`` are logged, and
    the plan is shown on the loader ``node`` (the node class ComfyUI runs) before its weights are read."""
    plan = plan_fit(components, choices)
    require_ram(name, plan)
    for note in notes:
        log.warning("[Device Control] %s: %s", name, note)
    lines = [f"Loading {name}: the fit plan, before any weight is read"]
    lines += [
        f"  {c.component.replace('_', ' ')}: {c.device}, {c.dtype}: {format_bytes(c.bytes)}" for c in plan.components
    ]
    lines += [f"  fit on {d.device}: {d.verdict}" for d in plan.devices]
    lines += [f"  warning: {note}" for note in notes]
    log.info("[Device Control] %s", "\n".join(lines))
    _show_on_node(node, "\n".join(lines))
    return plan


def _show_on_node(node: type | None, text: str) -> None:
    """Show ``text`` on the running node in the frontend, where ComfyUI can (its progress text)."""
    hidden = getattr(node, "hidden", None)
    node_id = getattr(hidden, "unique_id", None)
    if node_id is None or not surface.running_in_comfyui():
        return
    send = getattr(surface.prompt_server(), "send_progress_text", None)
    if callable(send):
        send(text, node_id)


def loaded(node: type, summary: str, *values: Any) -> Any:
    """The output of loader ``node`` (the class ComfyUI runs): ``values`` and its summary, on the canvas too; the
    panel is told at once, and the node remembers what it gave out (its text when it comes from the cache)."""
    panel.announce()
    remember(node, values)
    log.info("[Device Control] %s", summary)
    return surface.io.NodeOutput(*values, summary, ui={"text": (summary,)})


def summary_output() -> Any:
    """The ``summary`` output every loader of ours has."""
    return surface.io.String.Output(
        display_name="summary", tooltip="What was loaded where, in which dtype, and whether it fits."
    )


def resolve_placement(
    role: str, spec: str, dtype_name: str, detection: Detection, snapshot: InventorySnapshot, notes: list[str]
) -> tuple[ComponentPlan, Choice]:
    """Turn a node's device and dtype choice for one role into a placement and a fit-plan choice."""
    info, torch_device, chosen = _chosen_device(role, spec, snapshot, notes)
    dtype = _storage_dtype(role, dtype_name)
    target = inventory.target(info.id, snapshot) if chosen and info.id else torch_device
    compute = backend_of(target).comfy_device(target)  # the host, for a device ComfyUI does not know
    # The user chose this device: the placement goes with the model. (auto: ComfyUI decides, as its loader does.)
    managed = Placement(target, device_id=info.id) if chosen and info.id else None
    place = ComponentPlan(compute, target, dtype, placement=managed)
    return place, Choice(info, _CANDIDATE[dtype or default_dtype(role, compute, detection)])


def with_fit(place: ComponentPlan, plan: FitPlan, choice: Choice) -> ComponentPlan:
    """``place``, knowing whether its device holds what the fit plan put there."""
    fits = {d.device: d.fits for d in plan.devices}
    return dataclasses.replace(place, fits=fits.get(choice.device.id, True))


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


def require_kind(name: str, detection: Detection, kind: str, what: str, stock_loader: str) -> None:
    """Refuse, before anything is read, a file that is not of ``kind`` (``what``: how the node calls that kind),
    of no family ComfyUI can build, or with layers we cannot stream (which ``stock_loader`` loads), naming what the
    file is and which node takes it."""
    if detection.kind == "unknown":
        closest = "; ".join(detection.candidates[:3])
        raise UnknownModelError(
            f"{name} is not a model family ComfyUI can build (neither our header rules nor ComfyUI's own "
            f"detection recognise it): {detection.reason}."
            + (f" Closest: {closest}." if closest else "")
            + f" Check that the file is a complete {what}."
        )
    scaled = any(variant.startswith("scaled fp8") for variant in detection.variants)
    if "mixed-precision quantized layers" in detection.variants or (scaled and quantizes_scaled_fp8()):
        raise quantized_refusal(name, stock_loader)
    if detection.kind != kind:
        loader = LOADER_FOR.get(detection.kind, "the matching loader")
        if detection.file_format == "gguf" and not reads_gguf(detection):
            loader = f"a GGUF loader pack ({GGUF_READ}), or its safetensors with {loader}"
        raise DeviceControlError(
            f"{name} is a {detection.kind.replace('_', ' ')} ({detection.family}), not a {what}; load it with {loader}."
        )


#: The kinds whose Device Control loader reads GGUF files.
READS_GGUF = frozenset({"diffusion_model", "text_encoder"})
#: What Device Control reads of GGUF files, as the refusals say it.
GGUF_READ = (
    "Device Control reads GGUF diffusion models, and T5, UMT5 and Qwen3 text encoders in llama.cpp's names, so far"
)


def reads_gguf(detection: Detection) -> bool:
    """Whether a Device Control loader reads this GGUF file: a kind it loads, with ComfyUI's tensor names (a text
    encoder of an architecture ``core.detection.gguf_names`` does not map keeps llama.cpp's)."""
    return detection.kind in READS_GGUF and LLAMA_CPP_NAMED not in (detection.family or "")


def gguf_blocks(detection: Detection) -> str | None:
    """``GGUF Q8_0 blocks``: how a GGUF file's weights are kept (``None`` for another format)."""
    if detection.file_format != "gguf":
        return None
    kinds = {kind for c in detection.components for kind in c.stored_dtypes if kind not in ("F32", "F16", "BF16")}
    return f"GGUF {'/'.join(sorted(kinds)) or 'F16/F32'} blocks"


def refuse_unmapped_gguf(name: str, detection: Detection) -> None:
    """Refuse a GGUF file no loader of ours reads (a text encoder with llama.cpp's names), saying what takes it."""
    if detection.file_format == "gguf" and not reads_gguf(detection):
        raise DeviceControlError(
            f"{name} is a GGUF {detection.kind.replace('_', ' ')} ({detection.family}) that Device Control does not "
            f"read ({GGUF_READ}); load it with a GGUF loader pack, or load its safetensors file here."
        )


def quantizes_scaled_fp8() -> bool:
    """Whether the running ComfyUI turns scaled-fp8 files into its quantized layers while reading them (0.2x)."""
    return surface.old_quants_converter() is not None


def quantized_refusal(name: str, stock_loader: str) -> DeviceControlError:
    """The refusal of a file whose layers the running ComfyUI quantizes while reading them (``stock_loader``: the
    ComfyUI loader that takes it)."""
    return DeviceControlError(
        f"{name} stores its layers in fp8 with scales, which this ComfyUI ({surface.comfyui_version()}) turns into "
        "its quantized layers while reading them; Device Control cannot stream those yet. Load it with ComfyUI's "
        f"{stock_loader}, or use the fp16/bf16 file with an fp8 dtype here."
    )


def model_files(folder: str, *, gguf: bool = False) -> list[str]:
    """ComfyUI's list of ``folder``'s model files, with the folder's GGUF files where the node reads them
    (``gguf``): ComfyUI lists only the formats it loads itself."""
    folders = surface.folder_paths()
    names = set(folders.get_filename_list(folder))
    if gguf:
        for root in folders.get_folder_paths(folder):
            for directory, _subdirectories, files in os.walk(root, followlinks=True):
                names.update(os.path.relpath(os.path.join(directory, f), root) for f in files if is_gguf(f))
    return sorted(names)


def is_gguf(name: str) -> bool:
    """Whether ``name`` is a GGUF file's (by its extension, as ComfyUI tells formats apart)."""
    return name.lower().endswith(".gguf")


def model_path(folder: str, name: str, what: str, option: str) -> str:
    """The file ``name`` of ComfyUI's ``folder`` now; a clear error if it left the folder after the prompt was
    queued (``what``: how to call the file; ``option``: the node's input that names it)."""
    path = surface.folder_paths().get_full_path(folder, name)
    if path is None or not os.path.isfile(path):
        raise ModelFileError(
            f"{what} {name!r} is not in the {folder} folder any more (deleted or moved after the prompt was "
            f"queued). Put it back, or choose another in {option}, and queue the prompt again."
        )
    return path


def require_ram(name: str, plan: FitPlan) -> None:
    """Refuse, before anything is read, a load whose host share cannot fit in RAM."""
    host = next((d for d in plan.devices if d.device == "cpu"), None)
    if host is not None and not host.fits:
        raise DeviceControlError(
            f"{name} {host.verdict}. Nothing was read. Choose a smaller dtype (fp16 or fp8) for the "
            "largest component, put it on a GPU, or close programs that use RAM."
        )


def progress_bar() -> Any:
    """A progress callback that moves ComfyUI's bar and lets Cancel stop the load between two tensors."""
    mm = surface.model_management()
    bar = surface.comfy_utils().ProgressBar(1000)

    def report(done: int, total: int) -> None:
        mm.throw_exception_if_processing_interrupted()
        bar.update_absolute(int(1000 * done / max(total, 1)), 1000)

    return report
