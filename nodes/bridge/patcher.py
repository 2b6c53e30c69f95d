"""A ModelPatcher whose loading and unloading is Device Control's engine (``core.loading``).

ComfyUI moves a model with its patcher's ``load`` / ``partially_unload`` / ``unpatch_model`` whenever a node
uses it (``load_models_gpu``) or needs room (``free_memory``). This subclass keeps those entry points and
ComfyUI's books (``model_loaded_weight_memory``, ``model_lowvram``, ``lowvram_patch_counter``, the backups),
but the decisions and the moves are ours:

* the **placement** (device, budget, keep-resident) travels with the patcher and its clones, so every later
  ``load_models_gpu`` loads the model where the user put it, no more than the budget, and the next sampler
  does not undo a Move To GPU;
* the layers that stay resident are chosen by ``core.loading`` (policy, casting room, out-of-memory guard),
  and the move is checked for ComfyUI's cancel between layers;
* patches (LoRAs from ComfyUI's stock loaders included) go through ``core.patching``: resident weights are
  patched in float32 with an exact backup, streamed layers get an :class:`~core.patching.OnTheFlyPatch` that
  computes the same weight, so a LoRA gives the same image resident or streamed; a GGUF model's quantised
  weights are patched on the fly wherever they are (``quantized_patches``).

A simulated GPU has no torch device: ComfyUI sees the host as the load device and this patcher places the
resident layers on the simulated device. Its ``free_memory`` never runs for the host, so room on a simulated
device is made here, from ComfyUI's own list, least recently used first.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import namedtuple
from typing import Any

import torch

from ...core.devices.backends import backend_of
from ...core.devices.memory import free_bytes
from ...core.devices.tensors import Target, label_of, same_target
from ...core.placement.budget import Placement
from ...core.placement.engine import partial_model_of
from ...core.placement.load_report import LoadReport
from ...core.placement.plan import RESIDENT_MARK
from ...core.placement.rings import before_rewrite, settle
from ...core.units import format_bytes
from ...core.weights.patch_math import calculate_weight
from ...core.weights.patching import OnTheFlyPatch, get_weight, key_seed, round_to, set_weight
from .. import surface
from .auto_dtype import compute_for, follows_auto
from .books import (
    Holding,
    forget_loaded,
    holding_of,
    make_room_for,
    note_displacement,
    note_loaded,
    placement_of,
)
from .layer_hooks import PatcherHooks
from .layers import give_back_layers, take_layers
from .lora_coverage import report_coverage
from .patches import check_added, check_present, describe, lora_file
from .quantized_patches import attach, patched_weight, quantized_owner
from .split_books import book_parts
from .splits import SplitPlacement, load_split_into, release_split, split_in_force, split_placement_of
from .subjects import model_label

log = logging.getLogger("device_control")

#: What ComfyUI's unpatch reads from a backup entry.
Backup = namedtuple("Backup", ["weight", "inplace_update"])

#: Room left free for activations on a device whose memory ComfyUI does not manage, as ComfyUI leaves some on
#: the devices it manages.
HEADROOM = 256 * 1024**2


def last_load(patcher: Any) -> LoadReport | None:
    """What the last load of this patcher's model did (shared by its clones), or ``None``."""
    return getattr(patcher.model, "device_control_last_load", None)


def _keep_embeddings_resident(model: torch.nn.Module, engine: Any) -> None:
    """A text encoder computes where its token embedding is (ComfyUI's CLIP reads the embedding's device to
    place the tokens), so its embeddings never stream."""
    if not hasattr(model, "encode_token_weights") or model.__dict__.get("_device_control_embeddings_marked"):
        return
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            setattr(module, RESIDENT_MARK, True)
    model.__dict__["_device_control_embeddings_marked"] = True
    engine.refresh()


def _log_stopped(patcher: Any, target: Target, exc: BaseException) -> None:
    log.warning(
        "[Device Control] loading %s onto %s stopped (%s) with %s resident; every layer is resident or streams, "
        "and ComfyUI now moves the model back to RAM",
        model_label(patcher),
        label_of(target),
        type(exc).__name__,
        format_bytes(partial_model_of(patcher.model).resident_bytes(target)),
    )


def _interrupt_check(_done: int, _total: int) -> None:
    surface.throw_if_interrupted()


#: ComfyUI's own unpatch, for weights its loader left (see ``DeviceControlPatcher._take_over``).
_COMFY_UNPATCH = surface.model_patcher_class().unpatch_model


class DeviceControlPatcher(surface.model_patcher_class()):
    """ComfyUI's ModelPatcher, loaded and unloaded by ``core.loading`` under a placement."""

    #: Class-level default, so a ComfyUI patcher adopted by class change (no ``__init__``) has one.
    device_control_placement: Placement | None = None
    #: The same for a model split over several devices (Split Model Across Devices).
    device_control_split: SplitPlacement | None = None

    def add_patches(self, patches: Any, strength_patch: float = 1.0, strength_model: float = 1.0) -> Any:
        """ComfyUI's, after refusing a patch we cannot apply or one with NaN values (``bridge.patches``); then
        how much of the LoRA file this model takes is logged (``bridge.lora_coverage``)."""
        file = lora_file()
        check_added(patches, self.model.state_dict().keys(), describe(file))
        added = super().add_patches(patches, strength_patch, strength_model)
        if file is not None:
            report_coverage(self, file)
        return added

    def clone(self, *args: Any, **kwargs: Any) -> Any:
        n = super().clone(*args, **kwargs)
        if isinstance(n, DeviceControlPatcher):
            n.device_control_placement = self.device_control_placement
            n.device_control_split = self.device_control_split
        if follows_auto(n):
            n.size = 0  # measured again: a move may have converted the weights since this patcher was measured
        return n

    def cleanup(self) -> None:
        """ComfyUI's, at the end of each sampling; then the prefetch drops the copies it queued for a next step
        (``core.placement.rings.settle``), so nothing streamed stays on a device between runs."""
        super().cleanup()
        dropped = settle(self.model)
        if dropped:
            log.debug("[Device Control] sampling ended: %s queued ahead for a next step dropped", format_bytes(dropped))

    def patch_hooks(self, hooks: Any) -> None:
        """ComfyUI's, which writes a hook's weights into the model in place, between two calls of one sampling step
        when the conds carry different hooks; the copies queued ahead are waited for and forgotten first, since a
        copy of a weight made before it was rewritten in place cannot be told from one made after."""
        before_rewrite(self.model)
        super().patch_hooks(hooks)

    def unpatch_hooks(self, *args: Any, **kwargs: Any) -> None:
        """ComfyUI's, which writes the weights a hook replaced back in place: as :meth:`patch_hooks`."""
        before_rewrite(self.model)
        super().unpatch_hooks(*args, **kwargs)

    # -- loading -----------------------------------------------------------------------------------

    def load(
        self,
        device_to: Any = None,
        lowvram_model_memory: int = 0,
        force_patch_weights: bool = False,
        full_load: bool = False,
    ) -> None:
        device_to = device_to if device_to is not None else self.load_device
        split = split_placement_of(self)
        compute_for(self, device_to)  # a model whose dtype follows auto: its compute dtype for this device
        with self.use_ejected():
            self.unpatch_hooks()
            if split is not None:
                load_split_into(self, split, device_to, PatcherHooks(self, None, force_patch_weights, banked=False))
            else:
                self._load_placed(device_to, lowvram_model_memory if not full_load else 0, force_patch_weights)
            book_parts(self)  # a split's parts; those of a split this load ended leave ComfyUI's list
            for callback in self.get_all_callbacks(surface.on_load_callback_kind()):
                callback(self, device_to, lowvram_model_memory, force_patch_weights, full_load)
            self.apply_hooks(self.forced_hooks, force_apply=True)

    def _load_placed(self, device_to: Any, free_for_it: int, force_patch_weights: bool) -> None:
        """The engine's load onto one device, under this patcher's placement (ComfyUI's choice without one)."""
        placement = placement_of(self)
        target = placement.target if placement is not None else device_to
        engine = partial_model_of(self.model)
        if release_split(self.model, PatcherHooks(self, None, False)):
            note_displacement()
        _keep_embeddings_resident(self.model, engine)
        take_layers(self.model, engine)  # ComfyUI's standard layers stream in row slices too
        budget = self._budget(target, free_for_it)
        base = surface.base_model_class()  # a diffusion model runs step after step; a text encoder or VAE once a use
        engine.ring.wraps = base is None or isinstance(self.model, base)
        compute = device_to if isinstance(device_to, torch.device) and device_to.type != "cpu" else None
        try:
            report = engine.load(
                target, budget, hooks=PatcherHooks(self, compute, force_patch_weights), progress=_interrupt_check
            )
        except BaseException as exc:
            _log_stopped(self, target, exc)
            raise
        finally:
            self._sync_books(device_to)
        self.model.device_control_last_load = report
        note_loaded(self.model, placement)
        named = report if placement is None else dataclasses.replace(report, target=placement.name)  # gpu:0, as shown
        log.info(
            "[Device Control] loaded %s: %s; on-the-fly patches: %d",
            model_label(self),
            named.summary(),
            self.model.lowvram_patch_counter,
        )

    def _budget(self, target: Target, free_for_it: int) -> int:
        """Bytes the model may take on ``target``: its placement's budget (all of it without one), within what
        ComfyUI found free for it where it manages the memory; elsewhere ComfyUI made no room, so we make it."""
        placement = placement_of(self)
        engine = partial_model_of(self.model)
        budget = placement.budget_bytes() if placement is not None else engine.total_bytes()
        if backend_of(target).comfy_makes_room:
            return min(budget, int(free_for_it)) if free_for_it else budget
        wanted = min(budget, engine.total_bytes()) - engine.resident_bytes(target)
        make_room_for(self, target, wanted + HEADROOM)
        return max(0, min(budget, free_bytes(target) + engine.resident_bytes(target) - HEADROOM))

    def partially_load(self, device_to: Any, extra_memory: int = 0, force_patch_weights: bool = False) -> int:
        if split_placement_of(self) is not None:
            if not split_in_force(self):
                release_split(self.model, PatcherHooks(self, None, False))
                self._take_over(holding_of(self.model))
            loaded = super().partially_load(device_to, extra_memory, force_patch_weights)
            book_parts(self)
            return loaded
        if release_split(self.model, PatcherHooks(self, None, False)):
            note_displacement()
        placement = placement_of(self)
        wanted = placement.target if placement is not None else device_to
        holding = holding_of(self.model)
        if holding is None or not same_target(holding.target, wanted) or holding.placement != placement:
            self._take_over(holding)
        return super().partially_load(device_to, extra_memory, force_patch_weights)

    def _take_over(self, holding: Holding | None) -> None:
        """Make ComfyUI call :meth:`load`, which places the model as this patcher says, whatever state it is in.

        ComfyUI skips the load of a model it believes loaded in full, and its books cannot tell our placement
        from another: the weights may have been loaded by ComfyUI itself (an earlier run with its own nodes, a
        clone used by another branch of the graph, in full or in low-VRAM mode), or by us for another device or
        budget. Marking the model partial makes ComfyUI call ``load()``. When our engine does not hold the weights
        as it left them, ComfyUI's own unpatch first undoes what ComfyUI's loader did to them (patched weights
        restored from its backups, low-VRAM casts wiped), leaving every weight where it is, so the load moves
        only what must move.
        """
        if holding is None:
            self.model.model_lowvram = True  # so ComfyUI's unpatch wipes the cast marks of every layer
            _COMFY_UNPATCH(self, None, unpatch_weights=True)
        self.model.model_lowvram = True

    def partially_unload(self, device_to: Any, memory_to_free: int = 0, force_patch_weights: bool = False) -> int:
        engine = partial_model_of(self.model)
        with self.use_ejected():
            freed = release_split(self.model, PatcherHooks(self, None, force_patch_weights))
            freed += engine.unload(int(memory_to_free), hooks=PatcherHooks(self, None, force_patch_weights))
            self._sync_books(self.model.device if engine.target is not None else device_to)
        if freed:
            note_displacement()
        return freed

    def unpatch_model(self, device_to: Any = None, unpatch_weights: bool = True) -> None:
        if unpatch_weights:
            engine = partial_model_of(self.model)
            hooks = PatcherHooks(self, None, False)
            if release_split(self.model, hooks) + engine.unload_all(hooks=hooks):
                note_displacement()
            give_back_layers(self.model, engine)
            forget_loaded(self.model)
            self.model.model_lowvram = True  # ComfyUI's own unpatch then resets every layer's cast flags too
        super().unpatch_model(device_to, unpatch_weights)

    def patch_weight_to_device(
        self,
        key: str,
        device_to: Any = None,
        inplace_update: bool = False,
        return_weight: bool = False,
        force_cast: bool = False,
    ) -> torch.Tensor | None:
        """Patch one resident weight with ``core.weights.patching`` (float32 math, seeded rounding, exact backup).

        ``return_weight`` (newer ComfyUI: saving a checkpoint, extracting a LoRA) returns the patched weight
        instead, touching neither the model nor the backups; ``force_cast`` belongs to ComfyUI's Dynamic VRAM
        patcher, which this one never is, and is accepted for the same signature.
        """
        del force_cast
        if key not in self.patches:
            return surface.key_weight(self.model, key)[0] if return_weight else None
        quantized = quantized_owner(self.model, key)
        if quantized is not None:  # GGUF blocks: patched on the fly, after dequantisation, never in place
            owner, name = quantized
            if return_weight:
                return patched_weight(self.patches, key, owner, name)
            attach(owner, name, self.on_the_fly(key, getattr(owner, name)))
            return None
        weight, set_func, convert_func = surface.key_weight(self.model, key)
        inplace = self.weight_inplace_update or inplace_update
        if not return_weight:
            self._back_up(key, weight, inplace)
        patched = self._patched(key, weight, convert_func, device_to)
        if return_weight:  # only newer ComfyUI asks, and its set functions take return_weight
            if set_func is not None:
                return set_func(patched, inplace_update=False, seed=key_seed(key), return_weight=True)
            return round_to(patched, weight.dtype, key_seed(key), surface.fp8_rounding_noise())
        if set_func is not None:
            set_func(patched, inplace_update=inplace, seed=key_seed(key))
        else:
            rounded = round_to(patched, weight.dtype, key_seed(key), surface.fp8_rounding_noise())
            _put_weight(self.model, key, rounded, inplace)
        return None

    def _back_up(self, key: str, weight: torch.Tensor, inplace: bool) -> None:
        """Keep the original of ``key`` (once; a copy when it is patched in place), for an exact restore."""
        if key not in self.backup:
            self.backup[key] = Backup(weight.to(device=self.offload_device, copy=inplace), inplace)

    def _patched(self, key: str, weight: torch.Tensor, convert_func: Any, device: Any) -> torch.Tensor:
        """``weight`` with its patches applied, in float32 (the math of ``core.weights.patch_math``)."""
        work = weight.to(device=device or weight.device, dtype=torch.float32, copy=True)
        if convert_func is not None:
            work = convert_func(work, inplace=True)
        return calculate_weight(self.patches[key], work, key)

    def on_the_fly(self, key: str, param: torch.Tensor | None) -> OnTheFlyPatch:
        """The patch a streamed layer applies to weight ``key`` each time it is cast."""
        _weight, set_func, convert_func = surface.key_weight(self.model, key)
        plain = convert_func is None and set_func is None and param is not None and param.dtype.is_floating_point
        return OnTheFlyPatch(
            key,
            self.patches,
            storage_dtype=param.dtype if plain else None,
            convert_func=convert_func,
            set_func=set_func,
            fp8_noise=surface.fp8_rounding_noise(),
        )

    def _sync_books(self, device: Any) -> None:
        """ComfyUI's books for this model, from where its tensors are now."""
        engine = partial_model_of(self.model)
        model = self.model
        streamed = engine.streamed_layers() if engine.target is not None else []
        model.model_lowvram = bool(streamed)
        model.lowvram_patch_counter = _on_the_fly_count(streamed)
        model.model_loaded_weight_memory = min(engine.resident_bytes(), self.model_size())
        if hasattr(model, "model_offload_buffer_memory"):
            report = getattr(model, "device_control_last_load", None)
            model.model_offload_buffer_memory = report.plan.reserve_bytes if report and streamed else 0
        if device is not None:
            model.device = device
        model.current_weight_patches_uuid = self.patches_uuid if engine.target is not None else None


def _on_the_fly_count(streamed: list[Any]) -> int:
    """The on-the-fly patches of the streamed layers (a plain loop: the books are written at every sampling call)."""
    count = 0
    for layer in streamed:
        module = layer.module
        for functions in (getattr(module, "weight_function", ()), getattr(module, "bias_function", ())):
            for function in functions:
                count += isinstance(function, OnTheFlyPatch)
    return count


def _put_weight(model: torch.nn.Module, key: str, value: torch.Tensor, inplace: bool) -> None:
    if inplace:
        get_weight(model, key).data.copy_(value)
    else:
        set_weight(model, key, value)


def adopt(patcher: Any, placement: Placement | None) -> Any:
    """Make an existing ComfyUI patcher (a CLIP's, a VAE's) a :class:`DeviceControlPatcher` with ``placement``.

    Raises:
        PatchError: it carries a patch we cannot apply (checked before anything changes).
    """
    check_present(patcher)
    patcher.__class__ = DeviceControlPatcher  # the subclass adds behaviour and one attribute with a default
    patcher.device_control_placement = placement
    return patcher
