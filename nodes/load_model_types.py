"""Load ControlNet / CLIP Vision / Model Patch With Device: the models a workflow loads beside its diffusion model,
on the device, under the VRAM budget and in the dtype chosen.

Each node reads the file's header first and refuses, before a byte of weights is read, a file of another kind
(naming what it is and the node that takes it: ``core.detection.model_types``); then ComfyUI's own loader builds
the model, reading the file once, and Move To GPU's engine places it (``bridge.moves.move``), so it computes
where it was put, streams what its budget leaves in RAM, and shows in the panel like any model. ``auto`` with
the budget ``all`` is ComfyUI's own loader and nothing more.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core.detection.headers import read_header
from ..core.detection.model_types import MODEL_TYPE_NOUNS, ModelType, detect_model_type
from ..core.errors import DeviceControlError, InvalidSizeError, ModelFileError
from ..core.placement.budget import Budget
from ..core.units import format_bytes
from . import surface
from .bridge.dynamic_vram import classic_builds
from .bridge.moves import move
from .bridge.subjects import KIND_NOUNS
from .model_files import LOADER_FOR, model_path
from .placing import DTYPES, VAE_DTYPES, check_devices, device_input, dtype_input, loaded, summary_output
from .state import inventory

#: Each kind's node, for the refusal of a file of that kind given to another node.
TYPE_LOADERS = {
    "controlnet": "Load ControlNet With Device (or ComfyUI's Load ControlNet Model)",
    "clip_vision": "Load CLIP Vision With Device (or ComfyUI's Load CLIP Vision)",
    "model_patch": "Load Model Patch With Device (or ComfyUI's ModelPatchLoader)",
    "upscale_model": "ComfyUI's Load Upscale Model",
}
#: The dtypes these models may be stored in: ComfyUI builds them with layers that cast their weights to the
#: input's dtype, but has no fp8 path for them.
TYPE_DTYPES = VAE_DTYPES


def budget_input() -> Any:
    """The VRAM budget of a loaded model, as Move To GPU takes it."""
    return surface.io.String.Input(
        "vram_budget",
        default="all",
        tooltip=(
            "How much of the device the model may take: 'all', a size such as '1GB', or a share such as '25%'. "
            "Less than the model streams the rest from RAM when it computes (slower, never wrong)."
        ),
    )


def check_inputs(title: str, node: type, device: str | None, vram_budget: str | None, dtype: str | None) -> Any:
    """The ``validate_inputs`` answer of a loader here, when the prompt is queued."""
    if dtype is not None and dtype not in TYPE_DTYPES:
        return f"dtype: {dtype!r} is not a dtype this model can be stored in; choose one of {', '.join(TYPE_DTYPES)}."
    try:
        if vram_budget is not None:
            Budget.parse(vram_budget)
    except InvalidSizeError as exc:
        return f"vram_budget: {exc}"
    return check_devices(title, node, device=device)


def read_type(folder: str, name: str, wanted: str, option: str) -> tuple[str, ModelType]:
    """The path of file ``name`` of ComfyUI's ``folder`` and what its header says it is; a file of another kind
    is refused here, before any weight is read, naming what it is and the node that takes it."""
    noun = MODEL_TYPE_NOUNS[wanted]
    path = model_path(folder, name, noun, option)
    found = detect_model_type(read_header(path), wanted)
    if found.kind == "unknown":
        raise ModelFileError(
            f"{name} is not a {noun} this loader or ComfyUI's reads ({found.format}). Check that the file is "
            f"complete, and that it is a {noun}: the {folder} folder may hold a file of another kind."
        )
    if found.kind != wanted:
        loader = TYPE_LOADERS.get(found.kind) or LOADER_FOR.get(found.kind, "the loader of that kind")
        raise DeviceControlError(f"{name} is a {found.noun} ({found.format}), not a {noun}; load it with {loader}.")
    return path, found


def store_as(module: torch.nn.Module, dtype_name: str) -> str:
    """Convert ``module``'s floating-point weights to ``dtype_name`` in RAM, before it is placed (``auto``: as
    ComfyUI built it). Its layers cast their weights to the input's dtype, as ComfyUI builds them."""
    dtype = DTYPES[dtype_name]
    if dtype is not None:
        for tensor in (*module.parameters(), *module.buffers()):
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(dtype)
    stored = {str(t.dtype).replace("torch.", "") for t in module.parameters() if t.is_floating_point()}
    return "/".join(sorted(stored)) or "no weights"


def place_loaded(
    node: type, name: str, found: ModelType, value: Any, device: str, vram_budget: str, stored: str
) -> Any:
    """Place a model ComfyUI's loader built (``value``) and give the node's outputs: with ``auto`` and ``all``,
    ComfyUI's own placement (it loads the model where it computes, as its loader's output would be)."""
    lines = [f"{found.format} from {name}: {format_bytes(found.bytes)} in the file, stored as {stored}"]
    if device == "auto" and vram_budget.strip().lower() == "all":
        lines.append("  placed by ComfyUI, as its own loader's output (device auto, budget all)")
        return loaded(node, "\n".join(lines), value)
    result = move(value, device, vram_budget, False, inventory)
    lines += ["  " + line for line in result.text.splitlines()]
    return loaded(node, "\n".join(lines), result.value)


def build(found: ModelType, name: str, builder: Callable[[], Any]) -> Any:
    """``builder()`` (ComfyUI's loader), built the classic way even under Dynamic VRAM (so that it can be placed),
    with a clear error where it gives nothing back."""
    with classic_builds():
        value = builder()
    if value is None:
        raise ModelFileError(
            f"ComfyUI {surface.comfyui_version()} does not build {name} ({found.format}): it is newer than this "
            "ComfyUI knows. Update ComfyUI, or use a file of a format it reads."
        )
    return value


def loader_schema(
    node_id: str, title: str, description: str, file: tuple[str, str, str], kind: str, extra: tuple = ()
) -> Any:
    """The schema these loaders share: ``file`` (the input's name, ComfyUI's folder, how the tooltip calls the
    file), the device, the budget and the dtype of a ``kind`` (``CONTROL_NET``), and ``extra`` inputs."""
    io = surface.io
    name, folder, what = file
    noun = KIND_NOUNS[kind]
    return io.Schema(
        node_id=node_id,
        display_name=title,
        category="Device Control",
        description=description,
        inputs=[
            io.Combo.Input(
                name,
                options=surface.folder_paths().get_filename_list(folder),
                tooltip=f"The {what} file (from ComfyUI's {folder} folders).",
            ),
            device_input("device", noun),
            budget_input(),
            dtype_input("dtype", f"{noun} (no fp8)", TYPE_DTYPES),
            *extra,
        ],
        hidden=[io.Hidden.unique_id],
        outputs=[io.Custom(kind).Output(tooltip=OUTPUT_TOOLTIPS[kind]), summary_output()],
    )


#: What each loader's output is for.
OUTPUT_TOOLTIPS = {
    "CONTROL_NET": "For Apply ControlNet.",
    "CLIP_VISION": "The model, for CLIP Vision Encode.",
    "MODEL_PATCH": "The model patch.",
}


class LoadControlNetWithDevice(surface.io.ComfyNode):
    """Thin node: detection in ``core``, the build ComfyUI's, the placement Move To GPU's."""

    @classmethod
    def define_schema(cls) -> Any:
        model = surface.io.Model.Input(
            "model", optional=True, tooltip="For a difference ControlNet only: the diffusion model it was trained from."
        )
        return loader_schema(
            "DeviceControl_LoadControlNet",
            "Load ControlNet With Device",
            "Loads a ControlNet (or T2I-Adapter, Control-LoRA, difference ControlNet) as ComfyUI's Load ControlNet "
            "Model does, on the device, under the VRAM budget and in the dtype you choose: it computes there at every "
            "step, beside its diffusion model on the same or another GPU.",
            ("control_net_name", "controlnet", "ControlNet"),
            "CONTROL_NET",
            (model,),
        )

    @classmethod
    def validate_inputs(cls, device: str, vram_budget: str, dtype: str) -> bool | str:
        return check_inputs("Load ControlNet With Device", cls, device, vram_budget, dtype)

    @classmethod
    def execute(cls, control_net_name: str, device: str, vram_budget: str, dtype: str, model: Any = None) -> Any:
        path, found = read_type("controlnet", control_net_name, "controlnet", "control_net_name")
        if found.difference and model is None:
            raise DeviceControlError(
                f"{control_net_name} is a difference ControlNet: it is added to the diffusion model it was trained "
                "from. Connect that MODEL to this node's model input."
            )
        options = {} if DTYPES[dtype] is None else {"dtype": DTYPES[dtype]}
        net = build(found, control_net_name, lambda: surface.load_controlnet(path, model, options))
        wrapped = getattr(net, "control_model_wrapped", None)
        if not found.placeable or wrapped is None:
            summary = (
                f"{found.format} from {control_net_name}: ComfyUI moves it to its device itself each time it runs "
                "(it has no placement of its own), so device and budget are not applied"
            )
            return loaded(cls, summary, net)
        stored = store_as(wrapped.model, "auto")  # ComfyUI built it in the dtype chosen (``options``)
        return place_loaded(cls, control_net_name, found, net, device, vram_budget, stored)


class LoadCLIPVisionWithDevice(surface.io.ComfyNode):
    """Thin node: detection in ``core``, the build ComfyUI's, the placement Move To GPU's."""

    @classmethod
    def define_schema(cls) -> Any:
        return loader_schema(
            "DeviceControl_LoadCLIPVision",
            "Load CLIP Vision With Device",
            "Loads a CLIP vision model (for Redux, IP-Adapter, unCLIP, image-to-video) as ComfyUI's Load CLIP Vision "
            "does, on the device, under the VRAM budget and in the dtype you choose; CLIP Vision Encode runs there.",
            ("clip_name", "clip_vision", "CLIP vision"),
            "CLIP_VISION",
        )

    @classmethod
    def validate_inputs(cls, device: str, vram_budget: str, dtype: str) -> bool | str:
        return check_inputs("Load CLIP Vision With Device", cls, device, vram_budget, dtype)

    @classmethod
    def execute(cls, clip_name: str, device: str, vram_budget: str, dtype: str) -> Any:
        path, found = read_type("clip_vision", clip_name, "clip_vision", "clip_name")
        vision = build(found, clip_name, lambda: surface.load_clip_vision(path))
        stored = store_as(vision.patcher.model, dtype)
        if DTYPES[dtype] is not None:
            vision.dtype = DTYPES[dtype]
        return place_loaded(cls, clip_name, found, vision, device, vram_budget, stored)


class LoadModelPatchWithDevice(surface.io.ComfyNode):
    """Thin node: detection in ``core``, the build ComfyUI's (its ModelPatchLoader), the placement Move To GPU's."""

    @classmethod
    def define_schema(cls) -> Any:
        return loader_schema(
            "DeviceControl_LoadModelPatch",
            "Load Model Patch With Device",
            "Loads a model patch (the ControlNets of Qwen-Image and Z-Image, USO's style projector, ...) as ComfyUI's "
            "ModelPatchLoader does, on the device, under the VRAM budget and in the dtype you choose. It computes "
            "inside its diffusion model's steps: put it on that model's device.",
            ("name", "model_patches", "model patch"),
            "MODEL_PATCH",
        )

    @classmethod
    def validate_inputs(cls, device: str, vram_budget: str, dtype: str) -> bool | str:
        return check_inputs("Load Model Patch With Device", cls, device, vram_budget, dtype)

    @classmethod
    def execute(cls, name: str, device: str, vram_budget: str, dtype: str) -> Any:
        _path, found = read_type("model_patches", name, "model_patch", "name")
        loader = surface.stock_node("ModelPatchLoader")
        if loader is None:
            raise DeviceControlError(
                f"ComfyUI {surface.comfyui_version()} has no model patch loader (ModelPatchLoader); update ComfyUI."
            )
        patch = build(found, name, lambda: loader().load_model_patch(name)[0])
        stored = store_as(patch.model, dtype)
        return place_loaded(cls, name, found, patch, device, vram_budget, stored)
