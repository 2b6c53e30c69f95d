"""The patcher's side of the loading engine (``core.placement.streaming.LayerHooks``): how a layer's weights are
patched when it becomes resident, restored when it leaves, and patched on the fly while it streams, the way
ComfyUI's ModelPatcher expects (its backups, its ``weight_function`` lists, its weight wrappers)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ...core.devices.slices import ROW_QUANTUM
from ...core.devices.tensors import Target, own_tensors
from ...core.placement.streaming import LayerHooks
from ...core.weights.patch_factors import FactorBank, factor_bytes
from ...core.weights.patching import OnTheFlyPatch, get_weight, set_weight
from ...core.weights.quantized import weight_shape
from .quantized_patches import detach


class PatcherHooks(LayerHooks):
    """The patcher's side of the engine: patch, restore and stream its layers the way ComfyUI expects.

    The on-the-fly patches one set of hooks makes share a ``core.weights.patch_factors.FactorBank``: their factors
    cross in one block when the first of them computes, not a block per weight. A model split over devices
    (``banked`` false) places each weight's own, since its layers compute on several.
    """

    def __init__(self, patcher: Any, compute: torch.device | None, force: bool, *, banked: bool = True) -> None:
        self.patcher = patcher
        self.compute = compute
        self.force = force
        self.bank = FactorBank() if banked else None

    def _join(self, module: torch.nn.Module) -> None:
        """The load's bank takes the on-the-fly patches of ``module`` that have none."""
        if self.bank is None:
            return
        for attribute in ("weight_function", "bias_function"):
            for function in module.__dict__.get(attribute, ()):
                if isinstance(function, OnTheFlyPatch) and function.bank is None:
                    self.bank.join(function)

    def _keys(self, layer: Any) -> list[tuple[str, str]]:
        prefix = f"{layer.name}." if layer.name else ""
        return [(name, prefix + name) for name, _t, is_param in own_tensors(layer.module) if is_param]

    def before_resident(self, layer: Any, target: Target) -> None:
        module = layer.module
        if getattr(module, "comfy_patched_weights", False):
            return
        patcher = self.patcher
        for _name, key in self._keys(layer):
            if key in patcher.patches:
                patcher.patch_weight_to_device(key, device_to=self.compute)
        self._join(module)  # a quantised weight's patches apply on the fly, resident too
        _add_wrappers(patcher, layer)
        module.comfy_patched_weights = True

    def before_leaving(self, layer: Any) -> None:
        patcher = self.patcher
        for _name, key in self._keys(layer):
            backup = patcher.backup.pop(key, None)
            if backup is None:
                continue
            if backup.inplace_update:
                get_weight(patcher.model, key).data.copy_(backup.weight)
            else:
                set_weight(patcher.model, key, backup.weight)
        detach(layer.module, [key for _name, key in self._keys(layer)])  # a quantised weight's on-the-fly patches
        if "comfy_patched_weights" in layer.module.__dict__:
            layer.module.comfy_patched_weights = False

    def on_streamed(self, layer: Any) -> None:
        patcher = self.patcher
        module = layer.module
        for name, key in self._keys(layer):
            if key not in patcher.patches:
                continue
            if self.force:
                patcher.patch_weight_to_device(key)
                continue
            functions = module.weight_function if name == "weight" else module.bias_function
            if name in ("weight", "bias"):
                functions.append(patcher.on_the_fly(key, getattr(module, name)))
        self._join(module)
        _add_wrappers(patcher, layer)

    def patch_bytes(self) -> dict[str, int]:
        """The bytes the factors of each layer's on-the-fly patches take on the device while it streams (none when
        patches are forced into the stored weights)."""
        if self.force:
            return {}
        extras: dict[str, int] = {}
        for key, patches in self.patcher.patches.items():
            layer, _, name = key.rpartition(".")
            if patches and name in ("weight", "bias"):
                extras[layer] = extras.get(layer, 0) + factor_bytes(patches)
        return extras

    def slice_multiple(self, layer: Any) -> int | None:
        """Row slices of a streamed weight keep to the 64-row multiples, and to what its LoRA or other patch
        needs (``OnTheFlyPatch.slice_multiple``); ComfyUI's weight wrappers are functions of the whole weight."""
        patcher, module = self.patcher, layer.module
        key = f"{layer.name}.weight" if layer.name else "weight"
        if getattr(patcher, "weight_wrapper_patches", {}).get(key):
            return None
        if self.force or key not in patcher.patches:  # forced patches are in the stored weight: none on the fly
            return ROW_QUANTUM
        multiple = patcher.on_the_fly(key, module.weight).slice_multiple(weight_shape(module))
        return None if multiple is None else math.lcm(ROW_QUANTUM, multiple)


def _add_wrappers(patcher: Any, layer: Any) -> None:
    """ComfyUI's weight wrappers (``weight_wrapper_patches``) go on every layer, resident or streamed."""
    wrappers = getattr(patcher, "weight_wrapper_patches", {})
    prefix = f"{layer.name}." if layer.name else ""
    for name in ("weight", "bias"):
        extra = wrappers.get(prefix + name)
        if extra:
            attribute = f"{name}_function"
            setattr(layer.module, attribute, [*getattr(layer.module, attribute, []), *extra])
