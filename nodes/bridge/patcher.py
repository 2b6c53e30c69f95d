"""A ModelPatcher that keeps the placement Device Control chose, through every load ComfyUI makes.

ComfyUI moves a model to its patcher's ``load_device`` whenever a node uses it (``load_models_gpu``). For a
real device that is the device we chose, so ComfyUI's own loading keeps the placement. A simulated GPU has
no torch device: ComfyUI sees ``cpu`` as its load device, and this subclass, after ComfyUI's own ``load``
(which applies LoRA patches and decides which layers stream under the budget), places the resident
weights on the simulated device and marks the streamed ones. Unloading needs nothing extra: ComfyUI moves
weights to the offload device (the host), which takes them off the simulated device.

The target lives on the model (the ``nn.Module``), so every clone ComfyUI makes (``LoraLoader`` clones)
shares it, as clones share the weights.
"""

from __future__ import annotations

from typing import Any

import torch

from ...core.placement import place_module
from ...core.simulated import SimulatedDevice
from .. import surface

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

    def _sync_placement(self) -> None:
        target = target_of(self)
        if target is not None:
            place_module(self.model, target, streamed=_streams)


def adopt(patcher: Any, target: SimulatedDevice | None) -> Any:
    """Make an existing ComfyUI patcher (a CLIP's, a VAE's) a :class:`DeviceControlPatcher` on ``target``."""
    patcher.__class__ = DeviceControlPatcher  # the subclass adds behaviour only, no state
    set_target(patcher.model, target)
    return patcher
