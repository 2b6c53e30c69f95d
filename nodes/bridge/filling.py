"""What every loader of ours does once ComfyUI's models are built weightless: fill them where they go, and tell
ComfyUI where they are.

Each model's weights are written straight onto the device it fits on, through that device's backend
(``DeviceBackend.empty``), or to host memory; a device that fills up during the fill gets that model in RAM
instead, with a note. Then the model is registered with ComfyUI where it lives, as ComfyUI's own loaders do.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ...core.devices.backends import Target, backend_of
from ...core.devices.memory import is_out_of_memory
from ...core.files.reader import WeightReader
from ...core.files.skeleton import MaterializeResult, Source, materialize
from ...core.placement.budget import Placement
from ...core.placement.engine import partial_model_of
from ...core.progress import ProgressCallback
from ...core.weights.ops import CastLayer, can_cast
from .. import surface
from .auto_dtype import remember_auto

log = logging.getLogger("device_control")

#: Where each model's weights are written as they are read (by root name): a device's target, or None for RAM.
Fills = dict[str, Target | None]


@dataclass(frozen=True)
class ComponentPlan:
    """Where one component goes: the device ComfyUI computes on, and the target that holds its weights.

    ``device`` is ComfyUI's torch device (the host for a device torch does not know); ``None`` means ComfyUI's own
    default. ``target`` is the device itself. ``dtype`` ``None`` means ComfyUI's own choice.
    ``fits`` says whether the weights can be written straight onto the device (the fit plan's verdict); when
    not, they are written to host memory and loaded, as far as they fit, when used.
    ``placement`` is what the component's patcher carries from then on (``None``: ComfyUI decides).
    """

    device: torch.device | None = None
    target: Target | None = None
    dtype: torch.dtype | None = None
    fits: bool = True
    placement: Placement | None = None


def set_unet_dtype(config: Any, sd: dict, prefix: str, unet: ComponentPlan) -> torch.device:
    """Set the diffusion model's storage and compute dtypes on ``config``, as ComfyUI's loader would for the
    device it computes on; return that device."""
    mm, utils = surface.model_management(), surface.comfy_utils()
    compute = unet.device or mm.get_torch_device()
    # The file's dtype guides ComfyUI's choice, except where its layers carry their own scales (scaled fp8, quantized).
    scaled = getattr(config, "scaled_fp8", None) is not None or getattr(config, "quant_config", None) is not None
    params, file_dtype = utils.calculate_parameters(sd, prefix), None if scaled else utils.weight_dtype(sd, prefix)
    dtype = unet.dtype or mm.unet_dtype(  # the same choice default_dtype() made for the fit plan
        device=compute, model_params=params, supported_dtypes=config.supported_inference_dtypes, weight_dtype=file_dtype
    )
    if unet.dtype is None and not scaled:  # auto: a move asks ComfyUI again for the device it computes on then
        remember_auto(config, params, file_dtype)
    config.set_inference_dtype(dtype, mm.unet_manual_cast(dtype, compute, config.supported_inference_dtypes))
    return compute


class _Progress:
    """Bytes streamed into all the models so far, reported to the node's callback."""

    def __init__(self, roots: Mapping[str, torch.nn.Module], callback: ProgressCallback | None) -> None:
        self.total = sum(p.numel() * p.element_size() for root in roots.values() for p in root.parameters())
        self.done = 0
        self.callback = callback

    def step(self, module_done: int, _module_total: int) -> None:
        if self.callback is not None:
            self.callback(self.done + module_done, self.total)


def fill_models(
    roots: Mapping[str, torch.nn.Module],
    sources: Mapping[str, dict[str, Source]],
    reader: WeightReader,
    fill: Fills,
    progress: ProgressCallback | None,
    notes: list[str],
) -> None:
    """Fill each model of ``roots`` where ``fill`` says (``fill`` is updated where a device filled up)."""
    counted = _Progress(roots, progress)
    for name, root in roots.items():
        result = _fill_root(name, root, sources[name], reader, fill, counted, notes)
        counted.done += result.loaded_bytes
        real_missing = [k for k in result.missing if not k.endswith("text_projection.weight")]
        if real_missing:
            notes.append(
                f"{name}: {len(real_missing)} weights are not in the file and start at zero (e.g. {real_missing[0]})"
            )


def _fill_root(
    name: str,
    root: torch.nn.Module,
    sources: dict[str, Source],
    reader: WeightReader,
    fill: Fills,
    progress: _Progress,
    notes: list[str],
) -> MaterializeResult:
    """Fill one model where ``fill`` says; when the device fills up meanwhile, in RAM instead (noted)."""
    target = fill[name]
    if target is None:
        return materialize(root, sources, reader, progress=progress.step, keeps_blocks=keeps_blocks)
    backend = backend_of(target)
    try:
        return materialize(
            root, sources, reader, partial(backend.empty, target), progress=progress.step, keeps_blocks=keeps_blocks
        )
    except RuntimeError as exc:  # another process took memory since the fit plan, or fragmentation
        if not is_out_of_memory(exc):
            raise
        where = backend.label(target)
        log.warning(
            "[Device Control] %s did not fit on %s after all; loading it to RAM instead, ComfyUI will load what "
            "fits when it is used",
            name,
            where,
        )
        notes.append(f"{name}: did not fit on {where}; loaded to RAM, ComfyUI loads what fits when used")
        surface.model_management().soft_empty_cache()
        fill[name] = None
        return materialize(root, sources, reader, progress=progress.step, keeps_blocks=keeps_blocks)


def fill_target(place: ComponentPlan) -> Target | None:
    """Where weights are first written: the device they fit on, else host memory (``None``)."""
    return place.target if place.target is not None and place.fits else None


def torch_device(filled: Target | None) -> torch.device:
    """The torch device ComfyUI sees a model on once it was filled on ``filled`` (host memory for ``None``)."""
    return backend_of(filled).comfy_device(filled) if filled is not None else torch.device("cpu")


def first_load(patcher: Any, place: ComponentPlan, filled: Target | None) -> None:
    """Register the model with ComfyUI where it now lives, as ComfyUI does after its own loading."""
    # Some ComfyUIs (0.3.52's CLIP) measure the model while it is built, from its weightless stand-ins: measured
    # again now that it holds its weights (a GGUF's blocks are smaller than the float stand-ins).
    patcher.size = 0
    patcher.model_size()
    if patcher.load_device != torch_device(filled):
        return  # in RAM, to be loaded where it belongs when a node first uses it
    if filled is not None:
        # The weights were written on the device: say so first, or they would be loaded there a second time.
        partial_model_of(patcher.model).target = filled
        patcher._sync_books(patcher.load_device)
    # Where ComfyUI manages the device, the weights are there already and must stay in full; elsewhere our
    # patcher loads them now within the placement's budget.
    makes_room = place.target is None or backend_of(place.target).comfy_makes_room
    surface.model_management().load_models_gpu([patcher], force_full_load=makes_room)


def keeps_blocks(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` may hold a GGUF weight's quantised blocks: ComfyUI's standard layers (they become our cast
    layers, which dequantise, before the model is used) and ours."""
    return isinstance(layer, CastLayer) or (is_comfy_layer(type(layer)) and can_cast(type(layer)))


def is_comfy_layer(cls: type) -> bool:
    """ComfyUI's standard layer classes (its special ones, such as scaled-fp8 layers, keep their own code)."""
    return cls.__module__ == "comfy.ops" and cls.__qualname__.split(".")[0] in ("disable_weight_init", "manual_cast")
