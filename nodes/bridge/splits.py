"""Split Model Across Devices on ComfyUI's MODEL: one diffusion model over several devices.

The node works on a clone (as Move To GPU does): the clone's patcher carries a :class:`SplitPlacement` (the
allocation resolved on this machine and the mode) and ComfyUI's ``load_models_gpu`` puts it in place through
:class:`~nodes.bridge.patcher.DeviceControlPatcher`, which calls :func:`load_split_into`. ComfyUI's books then
hold one entry for the model, on the first device of the allocation (where the sampler's tensors are); the bytes
on each device are read from the weights (``core.placement.split_model``), which the eviction, the VRAM Report
and the panel use. Only the diffusion model is shared out: the layers ComfyUI's model uses outside it (its sampling
schedule) stay on the first device, beside the sampler's tensors. A CLIP's text encoders are shared out whole (the
transformer of each, in order); each one's output goes back where its caller made its embeddings.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ...core.devices.tensors import HOST, Target, same_target
from ...core.errors import DeviceControlError
from ...core.placement.allocation import Allocation
from ...core.placement.donors import stream_room
from ...core.placement.engine import partial_model_of
from ...core.placement.split import ACTIVATIONS
from ...core.placement.split_model import SplitModel, SplitRequest, load_split, plan_split, split_of
from ...core.placement.streaming import LayerHooks
from .. import surface
from .books import forget_loaded, make_room_for
from .layers import take_layers
from .subjects import model_label

log = logging.getLogger("device_control")


#: The module of ComfyUI's model that is shared out (its diffusion model); the rest stays beside the caller.
SHARED = "diffusion_model."


@dataclass(frozen=True)
class SplitPlacement:
    """What a split clone carries: the allocation as resolved here, the mode, each device's target, and what the
    user wrote (shown back in summaries and reports)."""

    allocation: Allocation
    mode: str
    targets: tuple[tuple[str, Target], ...]
    text: str

    @property
    def first(self) -> Target:
        """The first device: it computes in ``stream`` mode and receives the sampler's tensors."""
        return self.targets[0][1]

    def __str__(self) -> str:
        return f"{self.mode}, {self.allocation}"


def split_placement_of(patcher: Any) -> SplitPlacement | None:
    """The split a patcher carries, or ``None``."""
    return getattr(patcher, "device_control_split", None)


def request_of(patcher: Any, placement: SplitPlacement) -> SplitRequest:
    """What to share out of ``patcher``'s model: a diffusion model's layers, or those of each text encoder of a
    CLIP (whose transformers give their output back where their caller is); the others stay at home."""
    root = patcher.model
    entries = _entries(root)
    inside = tuple(f"{name}." for name in entries)
    layers = partial_model_of(root).layers()
    encoders = [] if SHARED in inside else [module.transformer for module in entries.values()]
    return SplitRequest(
        root=root,
        entries=tuple(entries.values()),
        layers=[layer for layer in layers if layer.name.startswith(inside)],
        allocation=placement.allocation,
        mode=placement.mode,
        home=_home(patcher),
        home_layers=[layer for layer in layers if not layer.name.startswith(inside)],
        key=(placement, patcher.patches_uuid),
        to_caller=tuple(encoders),
        once_per_use=bool(encoders),  # a text encoder runs once a prompt, a diffusion model once a step
        # Copies ahead beyond the streaming reserve only where ComfyUI's least room for sampling stays free too.
        keep_free=max(ACTIVATIONS, surface.minimum_inference_memory()),
    )


def _entries(root: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modules of ``root`` that are shared out, by module path: its diffusion model, or its text encoders
    (ComfyUI's ``SDClipModel`` and its kin: a module with ``encode_token_weights`` that runs its
    ``transformer``, in model order).

    Raises:
        DeviceControlError: it has neither.
    """
    diffusion_model = getattr(root, SHARED.rstrip("."), None)
    if diffusion_model is not None:
        return {SHARED.rstrip("."): diffusion_model}
    found: dict[str, torch.nn.Module] = {}
    for name, module in root.named_modules():  # parents come first: an encoder inside another is the other's
        if name and _is_text_encoder(module) and not name.startswith(tuple(f"{n}." for n in found)):
            found[name] = module
    if not found:
        raise DeviceControlError(
            f"{type(root).__name__} has neither a diffusion model nor a text encoder to split: connect the MODEL "
            "output of a diffusion-model loader or the CLIP output of a text-encoder loader."
        )
    return found


def _is_text_encoder(module: torch.nn.Module) -> bool:
    return hasattr(module, "encode_token_weights") and isinstance(getattr(module, "transformer", None), torch.nn.Module)


def _home(patcher: Any) -> Target:
    """Where ComfyUI puts the sampler's tensors for this model (its load device)."""
    device = patcher.load_device
    return device if isinstance(device, torch.device) else HOST


def split_in_force(patcher: Any) -> bool:
    """Whether ``patcher``'s model is held split as ``patcher`` says, with its patches."""
    placement = split_placement_of(patcher)
    held = split_of(patcher.model)
    return placement is not None and held is not None and held.key == (placement, patcher.patches_uuid)


def load_split_into(patcher: Any, placement: SplitPlacement, device_to: Any, hooks: LayerHooks) -> SplitModel:
    """Put ``patcher``'s model in place as ``placement`` says (nothing moves when it is already), making room on
    each device from other models first; ComfyUI's books for it are set from the weights afterwards.

    Raises:
        InvalidAllocationError: the allocation cannot hold it (nothing moved).
        DeviceControlError: a device ran out of memory (everything back in RAM).
    """
    root = patcher.model
    engine = partial_model_of(root)
    try:
        if split_in_force(patcher):
            return split_of(root)
        release_split(root, hooks)
        if engine.target is not None:  # placed on one device before: that placement ends here
            engine.unload_all(hooks=hooks)
            forget_loaded(root)
        take_layers(root, engine)
        request = request_of(patcher, placement)
        split = plan_split(request)
        room = stream_room(split) if request.mode == "stream" else 0  # on the computing device, the first part's
        for index, part in enumerate(split.parts):
            target = dict(placement.targets)[str(part.device)]
            if not same_target(target, HOST):
                make_room_for(patcher, target, part.nbytes + ACTIVATIONS + (room if index == 0 else 0))
        log.info("[Device Control] splitting %s (%s):\n%s", model_label(patcher), placement, split.summary())
        return load_split(request, split, dict(placement.targets), hooks)
    finally:
        _sync_books(patcher, device_to)


def _sync_books(patcher: Any, device: Any) -> None:
    """ComfyUI's books for a split model, from where its tensors are: loaded bytes are those on devices."""
    model = patcher.model
    held = split_of(model)
    streams = held is not None and held.streamed is not None and bool(held.streamed.layers)
    model.model_lowvram = streams
    model.lowvram_patch_counter = 0
    model.model_loaded_weight_memory = min(held.device_bytes(), patcher.model_size()) if held is not None else 0
    if hasattr(model, "model_offload_buffer_memory"):
        model.model_offload_buffer_memory = held.streamed.reserve_bytes if streams else 0
    model.device = device
    model.current_weight_patches_uuid = patcher.patches_uuid if held is not None else None


def release_split(root: Any, hooks: LayerHooks) -> int:
    """Undo a split of ``root`` (held or not: stale hooks come off too); bytes freed on devices."""
    held = root.__dict__.get("_device_control_split")
    return held.release(hooks) if held is not None else 0
