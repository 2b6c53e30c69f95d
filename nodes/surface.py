"""Every ComfyUI symbol the pack touches, in one place.

ComfyUI changes between versions, and memory-management packs are the first to break when it does: no other module
imports ComfyUI. Each symbol is looked up by feature, never by version number; a missing optional feature reads as
``None`` or ``False``, so callers can say "not available in this ComfyUI" instead of crashing.

ComfyUI module symbols used: :data:`COMFY_SYMBOLS` below (a test keeps it complete). The attributes of the objects
ComfyUI hands us (patchers, loaded-model entries, CLIP, VAE, model configs, the server), used by attribute, are
:data:`COMFY_ATTRIBUTES`, by the class that defines them; :data:`OPTIONAL` names those looked up by feature, which
a ComfyUI may lack. ``python -m tools.runtime.surface_check PATH`` checks both tables against any ComfyUI source tree.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from types import ModuleType
from typing import Any

try:
    from comfy_api.latest import ComfyExtension, io
except ImportError as _missing:  # a ComfyUI from before the V3 node API: the pack's __init__ says so, loads nothing
    ComfyExtension = io = None  # type: ignore[assignment,misc]
    NODE_API_MISSING: str | None = f"no V3 node API (comfy_api.latest: {_missing})"
else:
    # The oldest ComfyUI tested (0.3.75) is the first with ``io.MatchType``: an older one is refused by that feature.
    _lacking = [name for name in ("ComfyNode", "MatchType") if not hasattr(io, name)]
    NODE_API_MISSING = f"no io.{_lacking[0]} in its V3 node API (comfy_api.latest)" if _lacking else None

#: The surface functions that hand out a ComfyUI module (or object), and which one.
MODULE_ACCESSORS = {
    "model_management": "comfy.model_management",
    "model_detection": "comfy.model_detection",
    "supported_models": "comfy.supported_models",
    "comfy_sd": "comfy.sd",
    "comfy_utils": "comfy.utils",
    "comfy_lora": "comfy.lora",
    "comfy_memory_management": "comfy.memory_management",
    "model_patcher_module": "comfy.model_patcher",
    "folder_paths": "folder_paths",
    "prompt_server": "server.PromptServer.instance",
}

#: Every ComfyUI module attribute the pack uses, by module (``server.PromptServer.instance`` and its parts: objects
#: reached from a module). ``tests/core/test_surface.py`` fails on one used and not listed, or an import elsewhere.
COMFY_SYMBOLS: dict[str, tuple[str, ...]] = {
    "comfy_api.latest": ("ComfyExtension", "io"),
    "comfy_api.latest.io": (
        "AnyType",
        "Boolean",
        "Clip",
        "Combo",
        "ComfyNode",
        "Custom",
        "Hidden",
        "Image",
        "MatchType",
        "Model",
        "MultiType",
        "NodeOutput",
        "Schema",
        "String",
        "Vae",
    ),
    "comfy.clip_vision": ("load",),
    "comfy.controlnet": ("load_controlnet",),
    "comfy.float": ("_CK_STOCHASTIC_ROUNDING_AVAILABLE",),
    "comfy.lora": ("model_lora_keys_clip", "model_lora_keys_unet"),
    "comfy.memory_management": ("aimdo_enabled",),
    "comfy.model_base": ("BaseModel",),
    "comfy.model_detection": ("model_config_from_unet", "unet_prefix_from_state_dict"),
    "comfy.model_management": (
        "DISABLE_SMART_MEMORY",
        "LoadedModel",
        "MAX_PINNED_MEMORY",
        "PINNED_MEMORY",
        "TOTAL_PINNED_MEMORY",
        "cleanup_models",
        "cpu_state",
        "current_loaded_models",
        "get_torch_device",
        "intermediate_device",
        "load_models_gpu",
        "minimum_inference_memory",
        "soft_empty_cache",
        "text_encoder_device",
        "text_encoder_dtype",
        "throw_exception_if_processing_interrupted",
        "unet_dtype",
        "unet_manual_cast",
        "unet_offload_device",
        "vae_device",
        "vae_dtype",
        "vram_state",
    ),
    "comfy.model_patcher": ("CoreModelPatcher", "LowVramPatch", "ModelPatcher", "get_key_weight"),
    "comfy.ops": ("disable_weight_init", "manual_cast"),
    "comfy.patcher_extension": ("CallbacksMP",),
    "comfy.sd": ("CLIP", "CLIPType", "VAE", "detect_te_model", "load_text_encoder_state_dicts"),
    "comfy.supported_models": ("models",),
    "comfy.utils": (
        "ProgressBar",
        "calculate_parameters",
        "convert_old_quants",
        "get_tiled_scale_steps",
        "state_dict_prefix_replace",
        "tiled_scale",
        "weight_dtype",
    ),
    "comfyui_version": ("__version__",),
    "folder_paths": ("get_filename_list", "get_folder_paths", "get_full_path"),
    "nodes": ("NODE_CLASS_MAPPINGS",),
    "server": ("PromptServer",),
    "server.PromptServer.instance": (
        "app",
        "last_node_id",
        "prompt_queue",
        "routes",
        "send_progress_text",
        "send_sync",
    ),
    "server.PromptServer.instance.app": ("middlewares",),
    "server.PromptServer.instance.prompt_queue": ("currently_running", "get_current_queue_volatile", "mutex"),
    "server.PromptServer.instance.routes": ("get", "post"),
}

#: Attributes of ComfyUI's objects, by ``module:Class`` (``Class.attr``: of an object the class holds, such as the
#: model a patcher wraps). The server's ``prompt_queue`` is a ``PromptQueue``; its ``routes`` and ``app`` aiohttp's.
COMFY_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "comfy.model_patcher:ModelPatcher": (
        "add_patches",
        "apply_hooks",
        "backup",
        "cleanup",
        "clone",
        "clone_base_uuid",
        "current_loaded_device",
        "detach",
        "forced_hooks",
        "get_all_callbacks",
        "is_clone",
        "is_dynamic",
        "load",
        "load_device",
        "loaded_size",
        "model",
        "model_dtype",
        "model_patches_to",
        "model_size",
        "offload_device",
        "partially_load",
        "partially_unload",
        "patch_hooks",
        "patch_weight_to_device",
        "patches",
        "patches_uuid",
        "unpatch_hooks",
        "unpatch_model",
        "use_ejected",
        "weight_inplace_update",
        "weight_wrapper_patches",
        "model.current_weight_patches_uuid",
        "model.device",
        "model.lowvram_patch_counter",
        "model.model_loaded_weight_memory",
        "model.model_lowvram",
        "model.model_offload_buffer_memory",
    ),
    "comfy.model_patcher:ModelPatcherDynamic": ("get_non_dynamic_delegate",),
    "comfy.model_base:BaseModel": ("get_dtype", "load_model_weights", "manual_cast_dtype", "model_config"),
    "comfy.model_management:LoadedModel": (
        "currently_used",
        "device",
        "model",
        "model_finalizer",
        "model_unload",
        "real_model",
    ),
    "comfy.sd:CLIP": ("clone", "cond_stage_model", "load_sd", "patcher"),
    "comfy.sd:VAE": ("device", "first_stage_model", "patcher", "throw_exception_if_invalid", "vae_dtype"),
    "comfy.supported_models:SD15": ("clip_target",),  # each family defines its own: SD15 stands for them
    "comfy.supported_models_base:BASE": (
        "get_model",
        "process_clip_state_dict",
        "process_vae_state_dict",
        "set_inference_dtype",
        "supported_inference_dtypes",
        "vae_key_prefix",
    ),
    "comfy.ops:disable_weight_init": ("Conv1d", "Conv2d", "GroupNorm", "LayerNorm", "Linear"),
    "comfy.ops:manual_cast": ("Conv1d", "Conv2d", "GroupNorm", "LayerNorm", "Linear"),
    "server:PromptServer": ("app", "last_node_id", "prompt_queue", "routes", "send_progress_text", "send_sync"),
    "execution:PromptQueue": ("currently_running", "get_current_queue_volatile", "mutex"),
}

#: What a ComfyUI may lack: each is looked up by feature, and its absence reads as "not available".
OPTIONAL: frozenset[str] = frozenset(
    {
        "comfy.float._CK_STOCHASTIC_ROUNDING_AVAILABLE",
        "comfy_api.latest.io.MatchType",
        "comfy.memory_management.aimdo_enabled",
        "comfy.model_patcher.CoreModelPatcher",
        "comfy.model_management.MAX_PINNED_MEMORY",
        "comfy.model_management.PINNED_MEMORY",
        "comfy.model_management.TOTAL_PINNED_MEMORY",
        "comfy.utils.convert_old_quants",
        "comfy.model_patcher:ModelPatcherDynamic.get_non_dynamic_delegate",
        "comfy.model_patcher:ModelPatcher.clone_base_uuid",
        "comfy.model_patcher:ModelPatcher.is_dynamic",
        "comfy.model_patcher:ModelPatcher.model.model_offload_buffer_memory",
        "comfy.patcher_extension.CallbacksMP",
        "server:PromptServer.send_progress_text",
    }
)


def running_in_comfyui() -> bool:
    """Whether this process is a ComfyUI (it imports these before any custom node), not a tool or a test."""
    return "folder_paths" in sys.modules and "comfy.model_management" in sys.modules


def model_management() -> ModuleType:
    """``comfy.model_management`` (always the package-qualified module: a bare import makes a copy)."""
    return importlib.import_module("comfy.model_management")


def model_detection() -> ModuleType:
    """``comfy.model_detection``: ComfyUI's own model-family detection."""
    return importlib.import_module("comfy.model_detection")


def supported_models() -> ModuleType:
    """``comfy.supported_models``: ComfyUI's model family classes."""
    return importlib.import_module("comfy.supported_models")


def comfy_sd() -> ModuleType:
    """``comfy.sd``: the ``CLIP`` and ``VAE`` wrappers."""
    return importlib.import_module("comfy.sd")


def comfy_utils() -> ModuleType:
    """``comfy.utils``."""
    return importlib.import_module("comfy.utils")


def comfy_lora() -> ModuleType:
    """``comfy.lora``: the key maps that say which LoRA layer names patch which weights of a model."""
    return importlib.import_module("comfy.lora")


def clip_types() -> list[str]:
    """The text-encoder types the running ComfyUI's CLIP loaders offer (``sdxl`` is DualCLIPLoader's name for the
    default type), then every other ``comfy.sd.CLIPType``, as those loaders name them."""
    offered: list[str] = []
    for loader in ("CLIPLoader", "DualCLIPLoader"):
        try:
            offered += importlib.import_module("nodes").NODE_CLASS_MAPPINGS[loader].INPUT_TYPES()["required"]["type"][0]
        except (ImportError, AttributeError, KeyError, IndexError, TypeError):
            continue  # a ComfyUI whose loaders changed shape: its CLIPType names still serve
    return list(dict.fromkeys([*offered, *(member.name.lower() for member in comfy_sd().CLIPType)]))


def clip_type(name: str) -> Any:
    """The ``comfy.sd.CLIPType`` a loader's ``type`` names (an unknown name: the first, as ComfyUI's loaders do)."""
    members = list(comfy_sd().CLIPType)
    return next((member for member in members if member.name == name.upper()), members[0])


def load_text_encoders(state_dicts: list[dict], kind: Any, options: dict[str, Any]) -> Any:
    """``comfy.sd.load_text_encoder_state_dicts``: ComfyUI's CLIP, with the classic patcher (``disable_dynamic``)."""
    load = comfy_sd().load_text_encoder_state_dicts
    extra = {"disable_dynamic": True} if "disable_dynamic" in inspect.signature(load).parameters else {}
    embeddings = folder_paths().get_folder_paths("embeddings")
    return load(state_dicts=state_dicts, embedding_directory=embeddings, clip_type=kind, model_options=options, **extra)


def load_controlnet(path: str, model: Any, options: dict[str, Any]) -> Any:
    """``comfy.controlnet.load_controlnet``: a ControlNet (a difference ControlNet added to ``model``), with its
    ``model_options`` (``dtype``); ``None`` for a file it does not read."""
    return importlib.import_module("comfy.controlnet").load_controlnet(path, model=model, model_options=options)


def load_clip_vision(path: str) -> Any:
    """``comfy.clip_vision.load``: a CLIP vision model; ``None`` for a file it does not read."""
    return importlib.import_module("comfy.clip_vision").load(path)


def tiled_upscale(pixels: Any, function: Any, tile: int, overlap: int, scale: float) -> Any:
    """``comfy.utils.tiled_scale`` as ComfyUI's upscale node calls it, with its progress bar (one step a tile)."""
    utils = comfy_utils()
    steps = pixels.shape[0] * utils.get_tiled_scale_steps(pixels.shape[3], pixels.shape[2], tile, tile, overlap)
    return utils.tiled_scale(
        pixels,
        function,
        tile_x=tile,
        tile_y=tile,
        overlap=overlap,
        upscale_amount=scale,
        pbar=utils.ProgressBar(steps),
        output_device=intermediate_device(),
    )


def intermediate_device() -> Any:
    """``comfy.model_management.intermediate_device()``: where ComfyUI keeps images between nodes."""
    return model_management().intermediate_device()


def stock_node(node_id: str) -> Any:
    """ComfyUI's node class ``node_id`` (``nodes.NODE_CLASS_MAPPINGS``): its upscale model and model patch loaders
    are the only way to build those; ``None`` where this ComfyUI has no such node."""
    return importlib.import_module("nodes").NODE_CLASS_MAPPINGS.get(node_id)


def old_quants_converter() -> Any:
    """``comfy.utils.convert_old_quants`` (scaled fp8 to quantized layers, ComfyUI 0.2x), or ``None``."""
    return getattr(comfy_utils(), "convert_old_quants", None)


def model_patcher_class() -> type:
    """``comfy.model_patcher.ModelPatcher``."""
    return model_patcher_module().ModelPatcher


def model_patcher_module() -> ModuleType:
    """``comfy.model_patcher``: ``CoreModelPatcher`` is the class ComfyUI's loaders build (Dynamic VRAM's where on)."""
    return importlib.import_module("comfy.model_patcher")


def key_weight(model: Any, key: str) -> tuple[Any, Any, Any]:
    """``comfy.model_patcher.get_key_weight``: a weight and its layer's ``set_``/``convert_`` hooks."""
    return importlib.import_module("comfy.model_patcher").get_key_weight(model, key)


def standard_layer_classes() -> frozenset[type]:
    """ComfyUI's standard layer classes (the table above): our cast layers compute bit for bit as they do."""
    ops, names = importlib.import_module("comfy.ops"), COMFY_ATTRIBUTES["comfy.ops:disable_weight_init"]
    families = (ops.disable_weight_init, ops.manual_cast)
    return frozenset(getattr(family, name) for family in families for name in names if hasattr(family, name))


def folder_paths() -> ModuleType:
    """ComfyUI's ``folder_paths`` (model folders)."""
    return importlib.import_module("folder_paths")


def loaded_models() -> list[Any]:
    """A copy of ComfyUI's ``current_loaded_models``, safe to iterate while ComfyUI changes the list."""
    return list(getattr(model_management(), "current_loaded_models", []))


def loaded_model_list() -> list[Any]:
    """ComfyUI's ``current_loaded_models`` itself (to remove an entry exactly when ComfyUI would)."""
    return model_management().current_loaded_models


def cleanup_models() -> None:
    """``comfy.model_management.cleanup_models``: drop the entries whose model was freed (as ComfyUI does)."""
    model_management().cleanup_models()


def loaded_model_class() -> type:
    """``comfy.model_management.LoadedModel``: the class of the list's entries."""
    return model_management().LoadedModel


def load_models_gpu(patchers: list[Any], **options: Any) -> None:
    """``comfy.model_management.load_models_gpu``: load models the way every ComfyUI node does."""
    model_management().load_models_gpu(patchers, **options)


def throw_if_interrupted() -> None:
    """Raise ComfyUI's ``InterruptProcessingException`` when the user pressed Cancel."""
    model_management().throw_exception_if_processing_interrupted()


def soft_empty_cache() -> None:
    """Give the allocator's cached memory back to the device(s), as ComfyUI does after unloading."""
    model_management().soft_empty_cache()


def on_load_callback_kind() -> str:
    """The key of the patcher callbacks ComfyUI runs after a model loads (``CallbacksMP.ON_LOAD``)."""
    try:
        return importlib.import_module("comfy.patcher_extension").CallbacksMP.ON_LOAD
    except (ImportError, AttributeError):
        return "on_load"


def has_model_class(name: str) -> bool:
    """Whether the running ComfyUI builds the model family class ``name`` (``comfy.supported_models``)."""
    return any(cls.__name__ == name for cls in getattr(supported_models(), "models", ()))


def fp8_rounding_noise() -> str:
    """How the running ComfyUI draws the noise of fp8 stochastic rounding (``core.weights.patching.FP8_NOISE``):
    ``bytes`` where ``comfy.float`` rounds through comfy-kitchen (ComfyUI 0.2x), ``uniform`` before."""
    try:
        kitchen = getattr(importlib.import_module("comfy.float"), "_CK_STOCHASTIC_ROUNDING_AVAILABLE", False)
    except ImportError:
        kitchen = False
    return "bytes" if kitchen else "uniform"


def prompt_server() -> Any:
    """ComfyUI's ``server.PromptServer.instance``: its routes, ``send_sync``, ``prompt_queue``, ``last_node_id``."""
    return importlib.import_module("server").PromptServer.instance


def minimum_inference_memory() -> int:
    """``comfy.model_management.minimum_inference_memory()``: the least ComfyUI keeps free for sampling (or 0)."""
    found = getattr(model_management(), "minimum_inference_memory", None)
    return int(found()) if callable(found) else 0


def base_model_class() -> type | None:
    """``comfy.model_base.BaseModel``: the class of every diffusion model ComfyUI builds."""
    try:
        return importlib.import_module("comfy.model_base").BaseModel
    except (ImportError, AttributeError):
        return None


def comfy_memory_management() -> ModuleType | None:
    """``comfy.memory_management`` (Dynamic VRAM's switch, ``aimdo_enabled``); ``None`` where there is none."""
    try:
        return importlib.import_module("comfy.memory_management")
    except ImportError:
        return None


def comfyui_version() -> str:
    """The running ComfyUI's version, or ``"unknown"``."""
    try:
        return str(importlib.import_module("comfyui_version").__version__)
    except (ImportError, AttributeError):
        return "unknown"


def comfy_pinned_ranges() -> dict[int, int]:
    """ComfyUI's own page-locked host ranges (data pointer -> bytes); empty where it keeps no such books."""
    books = getattr(model_management(), "PINNED_MEMORY", None)
    return dict(books) if isinstance(books, dict) else {}


def comfy_pinned_cap() -> int | None:
    """ComfyUI's own cap on page-locked host memory: 0 where it pins nothing, ``None`` where it has no such cap."""
    cap = getattr(model_management(), "MAX_PINNED_MEMORY", None)
    return max(0, int(cap)) if isinstance(cap, (int, float)) else None
