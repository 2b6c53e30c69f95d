"""A ModelPatcher that keeps Device Control's placement and applies patches with Device Control's math.

ComfyUI moves a model to its patcher's ``load_device`` whenever a node uses it (``load_models_gpu``). For a
real device that is the device we chose, so ComfyUI's own loading keeps the placement. A simulated GPU has
no torch device: ComfyUI sees ``cpu`` as its load device, and this subclass, after ComfyUI's own ``load``
(which decides which layers stream under the budget), places the resident weights on the simulated device
and marks the streamed ones. Unloading needs nothing extra: ComfyUI moves weights to the offload device
(the host), which takes them off the simulated device.

Patches (LoRAs from ComfyUI's stock loaders included) go through ``core.patching``: resident weights are
patched by :meth:`DeviceControlPatcher.patch_weight_to_device`, and the low-VRAM patches ComfyUI attaches to
streamed layers are replaced by ``core.patching.OnTheFlyPatch``, which gives bit-identical results.

The target lives on the model (the ``nn.Module``), so every clone ComfyUI makes (``LoraLoader`` clones)
shares it, as clones share the weights.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import torch

from ...core.patch_math import calculate_weight
from ...core.patching import OnTheFlyPatch, get_weight, key_seed, round_to, set_weight
from ...core.placement import place_module
from ...core.simulated import SimulatedDevice
from .. import surface

#: What ComfyUI's unpatch reads from a backup entry.
Backup = namedtuple("Backup", ["weight", "inplace_update"])

_TARGET = "device_control_target"
#: Room left free on a simulated device for activations, as ComfyUI leaves on a real one.
SIMULATED_HEADROOM = 256 * 1024**2


def set_target(module: torch.nn.Module, target: SimulatedDevice | None) -> None:
    """Make ``module`` (a model, text encoder or VAE module tree) live on ``target``."""
    setattr(module, _TARGET, target)


def target_of(patcher: Any) -> SimulatedDevice | None:
    """The simulated device a patcher's model lives on, or ``None``."""
    return getattr(getattr(patcher, "model", None), _TARGET, None)


def _streams(module: torch.nn.Module) -> bool:
    # ComfyUI marks a layer it leaves on the host under a budget this way (and removes the mark on full load).
    return hasattr(module, "prev_comfy_cast_weights") and bool(getattr(module, "comfy_cast_weights", False))


class DeviceControlPatcher(surface.model_patcher_class()):
    """ComfyUI's ModelPatcher, plus placement on a simulated device when one is the target."""

    def load(
        self,
        device_to: Any = None,
        lowvram_model_memory: int = 0,
        force_patch_weights: bool = False,
        full_load: bool = False,
    ) -> None:
        target = target_of(self)
        if target is not None:
            # ComfyUI gives a CPU load device an unlimited budget; a simulated GPU has a capacity.
            budget = self.loaded_size() + target.free() - SIMULATED_HEADROOM
            lowvram_model_memory = max(1, min(lowvram_model_memory or budget, budget))
            full_load = full_load and self.model_size() <= budget
        super().load(device_to, lowvram_model_memory, force_patch_weights, full_load)
        self._sync_placement()

    def partially_unload(self, device_to: Any, memory_to_free: int = 0, force_patch_weights: bool = False) -> int:
        freed = super().partially_unload(device_to, memory_to_free, force_patch_weights)
        self._sync_placement()
        return freed

    def patch_weight_to_device(self, key: str, device_to: Any = None, inplace_update: bool = False) -> None:
        """Patch one resident weight with ``core.patching`` (float32 math, seeded rounding, exact backup)."""
        if key not in self.patches:
            return
        weight, set_func, convert_func = surface.key_weight(self.model, key)
        inplace = self.weight_inplace_update or inplace_update
        if key not in self.backup:
            self.backup[key] = Backup(weight.to(device=self.offload_device, copy=inplace), inplace)
        work = weight.to(device=device_to or weight.device, dtype=torch.float32, copy=True)
        if convert_func is not None:
            work = convert_func(work, inplace=True)
        patched = calculate_weight(self.patches[key], work, key)
        if set_func is not None:
            set_func(patched, inplace_update=inplace, seed=key_seed(key))
            return
        rounded = round_to(patched, weight.dtype, key_seed(key))
        if inplace:
            get_weight(self.model, key).data.copy_(rounded)
        else:
            set_weight(self.model, key, rounded)

    def _sync_placement(self) -> None:
        self._use_our_patches()
        target = target_of(self)
        if target is not None:
            place_module(self.model, target, streamed=_streams)

    def _use_our_patches(self) -> None:
        """Swap the low-VRAM patches ComfyUI attached to streamed layers for ours."""
        comfy_patch = surface.lowvram_patch_class()
        for module in self.model.modules():
            for functions_name, param_name in (("weight_function", "weight"), ("bias_function", "bias")):
                functions = module.__dict__.get(functions_name)
                if functions and any(isinstance(f, comfy_patch) for f in functions):
                    param = getattr(module, param_name, None)
                    module.__dict__[functions_name] = [
                        self._on_the_fly(f, param) if isinstance(f, comfy_patch) else f for f in functions
                    ]

    def _on_the_fly(self, patch: Any, param: torch.Tensor | None) -> OnTheFlyPatch:
        plain = patch.convert_func is None and patch.set_func is None and param is not None
        return OnTheFlyPatch(
            patch.key,
            self.patches,
            storage_dtype=param.dtype if plain else None,
            convert_func=patch.convert_func,
            set_func=patch.set_func,
        )


def adopt(patcher: Any, target: SimulatedDevice | None) -> Any:
    """Make an existing ComfyUI patcher (a CLIP's, a VAE's) a :class:`DeviceControlPatcher` on ``target``."""
    patcher.__class__ = DeviceControlPatcher  # the subclass adds behaviour only, no state
    set_target(patcher.model, target)
    return patcher
