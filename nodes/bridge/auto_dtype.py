"""A diffusion model loaded with dtype ``auto`` follows ComfyUI's choice for the device it computes on, when it
moves there (Move To GPU), not only for the device it was loaded to.

Why: a model loaded with ``auto`` to the CPU is stored in float32 (ComfyUI's choice for a CPU); moved to a GPU
it would keep float32, twice the VRAM of what stock ComfyUI holds there and not stock's image. So the loader
remembers that the user left the dtype to ComfyUI (:func:`remember_auto`), and a move asks ComfyUI again for the
new device (:func:`follow_auto`).

Decisions:

* Storage is converted only to a **smaller** dtype (float32 to float16 or bfloat16, and so on). A model that
  moves to a device ComfyUI would store in a wider dtype (back to the CPU) keeps its storage: widening gives no
  precision back and doubles the memory. Its compute dtype is re-derived instead (ComfyUI's manual cast), so a
  float16 model computes in float32 on a CPU, as ComfyUI computes any float16 model there.
* The conversion is **in place**, on the weights every clone shares, after every clone is unloaded from ComfyUI
  (so no LoRA is baked into what is converted): a copy would keep the float32 weights in RAM beside it for as long
  as ComfyUI caches the loader's output. The clones keep working: they compute from the converted weights. The
  slabs a streamed model's weights were packed into are let go with the old weights (the engine is told its layers
  changed), not kept in RAM beside the new ones until the next plan.
* ComfyUI's ``ModelPatcher.size`` is set once and copied to clones; the sizes of every clone in ComfyUI's list,
  the input and the moved clone are corrected, and every clone made afterwards measures its model again (the
  loader's cached output, cloned by a LoRA loader on the next run). A clone made before and held outside ComfyUI's
  list cannot be reached: it keeps the size it copied, so ComfyUI overestimates what loading it needs.
* Only the diffusion model follows ``auto``. A text encoder's ``auto`` is float16 on every device in ComfyUI
  already, and a VAE's is small; an explicit dtype never changes, nor does a scaled-fp8 model's (its scales stay
  float32, as ComfyUI keeps them).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ...core.devices.pinned import pinned_memory
from ...core.placement.engine import partial_model_of
from ...core.weights.ops import set_cast_flags
from .. import surface
from .books import clone_entries, unload_entries
from .storage import forget_dtype

log = logging.getLogger("device_control")


@dataclass(frozen=True)
class AutoChoice:
    """What ComfyUI's choice of a diffusion model's dtype was made from: its parameter count and the file's dtype."""

    params: int
    file_dtype: torch.dtype | None


#: Model configs (shared by every clone of a model) whose storage dtype the user left to ComfyUI.
_AUTO: weakref.WeakKeyDictionary[Any, AutoChoice] = weakref.WeakKeyDictionary()


def remember_auto(config: Any, params: int, file_dtype: torch.dtype | None) -> None:
    """Mark the model built from ``config`` as one whose dtype ComfyUI chose (the loader's ``auto``)."""
    _AUTO[config] = AutoChoice(params, file_dtype)


def follows_auto(patcher: Any) -> bool:
    """Whether ``patcher``'s model is a diffusion model whose dtype follows ``auto`` (see :func:`remember_auto`)."""
    config = getattr(getattr(patcher, "model", None), "model_config", None)
    return config is not None and config in _AUTO


def follow_auto(patcher: Any, input_patcher: Any, device: torch.device, name: str) -> str | None:
    """Store and compute ``patcher``'s model as ComfyUI would on ``device``, if it was loaded with ``auto``.

    ``input_patcher`` is the node's input (a clone of the same weights), whose size is corrected too. Returns a
    note for the node's summary when the weights were converted, else ``None`` (the compute dtype alone is set by
    :func:`compute_for` when the model loads).
    """
    if not follows_auto(patcher):
        return None
    model = patcher.model
    mm, config, choice = surface.model_management(), model.model_config, _AUTO[model.model_config]
    stored = model.get_dtype()
    wanted = mm.unet_dtype(
        device=device,
        model_params=choice.params,
        supported_dtypes=config.supported_inference_dtypes,
        weight_dtype=choice.file_dtype,
    )
    if not (wanted.is_floating_point and wanted.itemsize < stored.itemsize):
        return None  # the same or a wider dtype: the storage stays
    storage, cast = wanted, mm.unet_manual_cast(wanted, device, config.supported_inference_dtypes)
    _convert(model, _unload_clones(patcher, [input_patcher]), stored, storage)
    _set_dtypes(model, storage, cast)
    computes = f", computes in {_name(cast)}" if cast is not None else ""
    note = f"dtype auto: stored in {_name(storage)} for {name}{computes} (was {_name(stored)})"
    log.info("[Device Control] %s", note)
    return note


def compute_for(patcher: Any, device: torch.device) -> None:
    """Before each load of a model whose dtype follows ``auto``: its compute dtype for ``device``, as ComfyUI
    picks it for a model stored so (a clone computing on the CPU casts float16 storage to float32; one on a GPU
    computes in float16). Clones share the model: each load sets it for the device that load goes to (ComfyUI
    unloads the other clones of a model before it loads one)."""
    if not follows_auto(patcher):
        return
    model = patcher.model
    cast = surface.model_management().unet_manual_cast(
        model.get_dtype(), device, model.model_config.supported_inference_dtypes
    )
    if cast is not None or cast != model.manual_cast_dtype:  # a cast: every layer's flag is set again, cheaply
        _set_dtypes(model, model.get_dtype(), cast)


def _unload_clones(patcher: Any, others: list[Any]) -> list[Any]:
    """Unload every clone of ``patcher`` (no LoRA baked in, no layer streaming); the patchers that hold it."""
    loaded = clone_entries(patcher)
    holders = [patcher, *others, *(entry.model for entry in loaded)]
    unload_entries(loaded)
    if partial_model_of(patcher.model).target is not None:  # resident without an entry in ComfyUI's list
        patcher.detach()
    return holders


def _convert(model: Any, holders: list[Any], old: torch.dtype, new: torch.dtype) -> None:
    """Convert the shared weights stored in ``old`` to ``new``, in place; correct every holder's size."""
    pinned = pinned_memory()
    with torch.no_grad():
        for module in model.diffusion_model.modules():
            for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if tensor.dtype != old:
                    continue  # as ComfyUI builds the model for ``new``: its weights and tables in ``old`` change
                pinned.unlock(tensor)  # never free page-locked memory still registered (unloading unpins it already)
                tensor.data = tensor.data.to(new)
                if hasattr(module, f"{name}_comfy_model_dtype"):  # ComfyUI 0.28+'s record of each tensor's dtype
                    setattr(module, f"{name}_comfy_model_dtype", new)
    partial_model_of(model).refresh()
    forget_dtype(model)
    forget_dtype(model.diffusion_model)
    for holder in holders:
        holder.size = 0  # ComfyUI's ModelPatcher measures its model again when asked next
        holder.model_size()


def _set_dtypes(model: Any, storage: torch.dtype, cast: torch.dtype | None) -> None:
    """Tell ComfyUI's model how it is stored and computed now (as its loader would have for this device)."""
    model.model_config.set_inference_dtype(storage, cast)
    model.diffusion_model.dtype = storage
    model.manual_cast_dtype = cast
    set_cast_flags(model.diffusion_model, storage, cast)  # resident layers in the compute dtype cast no more


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
