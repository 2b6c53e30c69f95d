"""Every ComfyUI symbol the pack touches, in one place.

ComfyUI changes between versions, and memory-management packs are the first to break when it does. So no
other module of the pack imports ComfyUI: they import from here. Each symbol is looked up by feature
(does the attribute exist?), never by version number, and a missing optional feature reads as ``None``
or ``False`` so callers can say "not available in this ComfyUI" instead of crashing.

Symbols used (module: names):

* ``comfy_api.latest``: ``ComfyExtension``, ``io``, ``ui``
* ``comfy.model_management``: ``current_loaded_models``, ``LoadedModel`` (subclassed in ``bridge.books``),
  ``vram_state``, ``cpu_state``, ``DISABLE_SMART_MEMORY``, ``get_torch_device``, ``TOTAL_PINNED_MEMORY``
  (optional), ``unet_dtype``, ``unet_manual_cast``, ``unet_offload_device``, ``text_encoder_device``,
  ``text_encoder_dtype``, ``vae_device``, ``vae_dtype``, ``load_models_gpu``, ``soft_empty_cache``,
  ``throw_exception_if_processing_interrupted``
* ``comfy.patcher_extension``: ``CallbacksMP.ON_LOAD``
* ``server``: ``PromptServer.instance`` (``routes``, ``send_sync``, ``prompt_queue`` with ``mutex``,
  ``currently_running`` and ``get_current_queue_volatile()``, ``last_node_id``)
* ``comfy.model_base``: ``BaseModel``
* ``comfy.model_detection``: ``unet_prefix_from_state_dict``, ``model_config_from_unet``
* ``comfy.supported_models``: the family classes' ``supported_inference_dtypes``
* ``comfy.model_patcher``: ``ModelPatcher`` (subclassed in ``bridge.patcher``), ``get_key_weight``,
  ``LowVramPatch``; patcher attributes ``patches``, ``backup``, ``weight_inplace_update``
* ``comfy.sd``: ``CLIP``, ``VAE``
* ``comfy.utils``: ``ProgressBar``, ``state_dict_prefix_replace``, ``calculate_parameters``, ``weight_dtype``
* ``folder_paths``: ``get_filename_list``, ``get_full_path``, ``get_folder_paths``
* ``comfy.memory_management``: ``aimdo_enabled`` (optional: Dynamic VRAM, ComfyUI >= 0.16)
* ``comfyui_version``: ``__version__`` (optional, for reports)
* ModelPatcher objects (duck-typed): ``model``, ``load_device``, ``offload_device``, ``model_size()``,
  ``loaded_size()``, ``model_dtype()``, ``is_dynamic()`` (optional), ``clone(disable_dynamic=True)``
  (optional), ``is_clone()``, ``partially_unload()``, ``patches``, ``patches_uuid``, ``backup``,
  ``weight_wrapper_patches``, ``use_ejected()``, ``unpatch_hooks()``, ``apply_hooks()``, ``forced_hooks``,
  ``get_all_callbacks()``; the model's ``model_loaded_weight_memory``, ``model_lowvram``,
  ``lowvram_patch_counter``, ``model_offload_buffer_memory`` (optional), ``current_weight_patches_uuid``,
  ``device``; ``LoadedModel.model``, ``LoadedModel.device``, ``LoadedModel.currently_used``,
  ``LoadedModel.model_unload()``; CLIP ``patcher``, ``cond_stage_model``,
  ``load_sd``; VAE ``patcher``, ``first_stage_model``, ``device``, ``vae_dtype``; model configs
  ``set_inference_dtype``, ``get_model``, ``supported_inference_dtypes``, ``vae_key_prefix``,
  ``process_vae_state_dict``, ``clip_target``, ``process_clip_state_dict``; ``BaseModel.load_model_weights``
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from comfy_api.latest import ComfyExtension, io, ui

__all__ = [
    "ComfyExtension",
    "base_model_class",
    "comfy_sd",
    "comfy_utils",
    "comfyui_version",
    "dynamic_vram_enabled",
    "folder_paths",
    "io",
    "is_dynamic",
    "key_weight",
    "load_models_gpu",
    "loaded_model_class",
    "loaded_model_list",
    "loaded_models",
    "lowvram_patch_class",
    "model_detection",
    "model_management",
    "model_patcher_class",
    "on_load_callback_kind",
    "prompt_server",
    "soft_empty_cache",
    "supported_models",
    "throw_if_interrupted",
    "ui",
]


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


def model_patcher_class() -> type:
    """``comfy.model_patcher.ModelPatcher``."""
    return importlib.import_module("comfy.model_patcher").ModelPatcher


def key_weight(model: Any, key: str) -> tuple[Any, Any, Any]:
    """``comfy.model_patcher.get_key_weight``: a weight and its layer's ``set_``/``convert_`` hooks."""
    return importlib.import_module("comfy.model_patcher").get_key_weight(model, key)


def lowvram_patch_class() -> type:
    """``comfy.model_patcher.LowVramPatch``: the patch ComfyUI attaches to streamed layers."""
    return importlib.import_module("comfy.model_patcher").LowVramPatch


def folder_paths() -> ModuleType:
    """ComfyUI's ``folder_paths`` (model folders)."""
    return importlib.import_module("folder_paths")


def loaded_models() -> list[Any]:
    """A copy of ComfyUI's ``current_loaded_models``, safe to iterate while ComfyUI changes the list."""
    return list(getattr(model_management(), "current_loaded_models", []))


def loaded_model_list() -> list[Any]:
    """ComfyUI's ``current_loaded_models`` itself (to remove an entry exactly when ComfyUI would)."""
    return model_management().current_loaded_models


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


def is_dynamic(patcher: Any) -> bool:
    """Whether a patcher is ComfyUI's Dynamic VRAM one (``ModelPatcherDynamic``); ``False`` where that
    feature does not exist."""
    check = getattr(patcher, "is_dynamic", None)
    return bool(check()) if callable(check) else False


def prompt_server() -> Any:
    """ComfyUI's ``server.PromptServer.instance``: its routes, ``send_sync``, ``prompt_queue``, ``last_node_id``."""
    return importlib.import_module("server").PromptServer.instance


def base_model_class() -> type | None:
    """``comfy.model_base.BaseModel``: the class of every diffusion model ComfyUI builds."""
    try:
        return importlib.import_module("comfy.model_base").BaseModel
    except (ImportError, AttributeError):
        return None


def dynamic_vram_enabled() -> bool | None:
    """Whether ComfyUI's Dynamic VRAM (comfy-aimdo) is on; ``None`` where this ComfyUI has no such feature."""
    try:
        memory_management = importlib.import_module("comfy.memory_management")
    except ImportError:
        return None
    flag = getattr(memory_management, "aimdo_enabled", None)
    return None if flag is None else bool(flag)


def comfyui_version() -> str:
    """The running ComfyUI's version, or ``"unknown"``."""
    try:
        return str(importlib.import_module("comfyui_version").__version__)
    except (ImportError, AttributeError):
        return "unknown"
