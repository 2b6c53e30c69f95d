"""Build a checkpoint's MODEL, CLIP and VAE with ComfyUI's own classes, and fill them our way.

The models are built weightless and their sources traced (``tracing``); then each parameter is allocated
once, in the dtype ComfyUI chose for it and on the device we chose, and streamed from the file
(``core.files.skeleton``). The result is what ComfyUI builds, tensor for tensor, at a fraction of the peak
memory; its patchers carry the placements chosen.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from ...core.detection.detect import Detection
from ...core.detection.headers import FileHeader
from ...core.devices.backends import Target, backend_of
from ...core.errors import UnknownModelError
from ...core.files.reader import WeightReader
from ...core.files.skeleton import MaterializeResult, Source, materialize
from ...core.placement.budget import Placement
from ...core.placement.engine import partial_model_of
from ...core.progress import ProgressCallback
from ...core.weights.ops import convert
from .. import surface
from .patcher import DeviceControlPatcher, adopt
from .reading import dominant_dtype
from .tracing import Traced, build_traced, config_of, stand_ins

log = logging.getLogger("device_control")


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


@dataclass
class BuiltCheckpoint:
    """ComfyUI's three objects, plus what loading them found worth telling the user."""

    model: Any
    clip: Any
    vae: Any
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Places:
    """The three components' plans, by role."""

    unet: ComponentPlan
    clip: ComponentPlan
    vae: ComponentPlan


def build_checkpoint(
    header: FileHeader,
    detection: Detection,
    placements: dict[str, ComponentPlan],
    progress: ProgressCallback | None = None,
) -> BuiltCheckpoint:
    """Build ``header``'s file as ComfyUI would, with each component placed as ``placements`` says.

    Args:
        header: the file's header.
        detection: our detection of it (its ComfyUI class is cross-checked with ComfyUI's own detection).
        placements: by role: ``"diffusion_model"``, ``"text_encoder"``, ``"vae"``.
        progress: called with (bytes done, bytes total) while weights stream in; may raise to interrupt.

    Raises:
        UnknownModelError: ComfyUI cannot build this file, or builds a different class than detected.
        ModelFileError: a tensor is missing or misshapen in the file.
    """
    places = _Places(*(placements.get(role, ComponentPlan()) for role in ("diffusion_model", "text_encoder", "vae")))
    notes: list[str] = []
    with WeightReader(header, pin_staging=any(_is_cuda(p.device) for p in placements.values())) as reader:
        sd = stand_ins(header, reader)
        config, prefix = config_of(sd, header, detection)
        compute = _set_unet_dtype(config, sd, prefix, places.unet)
        traced = build_traced(config, sd, prefix, header, reader, places)
        fill = {"model": _fill_target(places.unet), "clip": _fill_target(places.clip), "vae": None}
        _fill_all(traced, reader, fill, _Progress(traced, progress), notes)
    traced.model.device = _torch_device(fill["model"])
    for root in traced.roots.values():  # ComfyUI's standard layers become ours: casts and patches run our code
        convert(root, accept=_is_comfy_layer)
    patcher = DeviceControlPatcher(
        traced.model,
        load_device=compute,
        offload_device=surface.model_management().unet_offload_device(),
    )
    patcher.device_control_placement = places.unet.placement
    _adopt_and_register(patcher, traced, places, fill)
    return BuiltCheckpoint(patcher, traced.clip, traced.vae, notes)


def _set_unet_dtype(config: Any, sd: dict, prefix: str, unet: ComponentPlan) -> torch.device:
    """Set the diffusion model's storage and compute dtypes on ``config``, as ComfyUI's loader would for the
    device it computes on; return that device."""
    mm, utils = surface.model_management(), surface.comfy_utils()
    compute = unet.device or mm.get_torch_device()
    dtype = unet.dtype or mm.unet_dtype(  # the same choice default_dtype() made for the fit plan
        device=compute,
        model_params=utils.calculate_parameters(sd, prefix),
        supported_dtypes=config.supported_inference_dtypes,
        weight_dtype=utils.weight_dtype(sd, prefix),
    )
    config.set_inference_dtype(dtype, mm.unet_manual_cast(dtype, compute, config.supported_inference_dtypes))
    return compute


class _Progress:
    """Bytes streamed into all the models so far, reported to the node's callback."""

    def __init__(self, traced: Traced, callback: ProgressCallback | None) -> None:
        self.total = sum(p.numel() * p.element_size() for root in traced.roots.values() for p in root.parameters())
        self.done = 0
        self.callback = callback

    def step(self, module_done: int, _module_total: int) -> None:
        if self.callback is not None:
            self.callback(self.done + module_done, self.total)


#: Where each model's weights are written as they are read: a device's target, or None for host memory.
Fills = dict[str, Target | None]


def _fill_all(traced: Traced, reader: WeightReader, fill: Fills, progress: _Progress, notes: list[str]) -> None:
    for name, root in traced.roots.items():
        result = _fill_root(name, root, traced.sources[name], reader, fill, progress, notes)
        progress.done += result.loaded_bytes
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
        return materialize(root, sources, reader, progress=progress.step)
    backend = backend_of(target)
    try:
        return materialize(root, sources, reader, partial(backend.empty, target), progress=progress.step)
    except torch.OutOfMemoryError:  # another process took memory since the fit plan, or fragmentation
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
        return materialize(root, sources, reader, progress=progress.step)


def _adopt_and_register(patcher: Any, traced: Traced, places: _Places, fill: Fills) -> None:
    """The text encoder's and the VAE's patchers carry their placements; ComfyUI learns where each model is."""
    mm = surface.model_management()
    if traced.clip is not None:
        adopt(traced.clip.patcher, places.clip.placement)
    adopt(traced.vae.patcher, places.vae.placement)
    _first_load(mm, patcher, places.unet, fill["model"])
    if traced.clip is not None:
        _first_load(mm, traced.clip.patcher, places.clip, fill["clip"])


_STORED = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def default_dtype(role: str, device: torch.device, detection: Detection) -> torch.dtype:
    """The storage dtype ComfyUI picks for ``role`` on ``device`` (its ``unet_dtype`` and friends)."""
    mm = surface.model_management()
    if role == "diffusion_model":
        unet = detection.component("diffusion_model")[0]
        family = getattr(surface.supported_models(), detection.comfy_class, None)
        if family is None:
            raise UnknownModelError(
                f"{detection.path} is a {detection.family} ({detection.comfy_class}), which this ComfyUI "
                f"({surface.comfyui_version()}) cannot build; update ComfyUI to load it."
            )
        stored = _STORED.get(unet.stored_dtypes[0]) if len(unet.stored_dtypes) == 1 else None
        return mm.unet_dtype(
            device=device,
            model_params=unet.parameter_count,
            supported_dtypes=family.supported_inference_dtypes,
            weight_dtype=stored,
        )
    if role == "text_encoder":
        return mm.text_encoder_dtype(device)
    return mm.vae_dtype(device)


def built_dtypes(built: BuiltCheckpoint) -> dict[str, str]:
    """How each part is stored (and, for the diffusion model, computed) now that it is loaded."""
    model = built.model.model
    cast = getattr(model, "manual_cast_dtype", None)
    unet = _name(model.get_dtype()) + (f" (computes in {_name(cast)})" if cast is not None else "")
    clip = built.clip.cond_stage_model if built.clip is not None else None
    return {
        "diffusion_model": unet,
        "text_encoder": _name(dominant_dtype(clip) if clip is not None else None),
        "vae": _name(built.vae.vae_dtype),
    }


def _name(dtype: torch.dtype | None) -> str:
    return str(dtype).replace("torch.", "") if dtype is not None else "-"


def _is_comfy_layer(cls: type) -> bool:
    """ComfyUI's standard layer classes (its special ones, such as scaled-fp8 layers, keep their own code)."""
    return cls.__module__ == "comfy.ops" and cls.__qualname__.split(".")[0] in ("disable_weight_init", "manual_cast")


def _fill_target(place: ComponentPlan) -> Target | None:
    """Where weights are first written: the device they fit on, else host memory (``None``). The VAE is always
    written to host memory: ComfyUI moves it to its device when it decodes."""
    return place.target if place.target is not None and place.fits else None


def _torch_device(filled: Target | None) -> torch.device:
    """The torch device ComfyUI sees a model on once it was filled on ``filled`` (host memory for ``None``)."""
    return backend_of(filled).comfy_device(filled) if filled is not None else torch.device("cpu")


def _first_load(mm: Any, patcher: Any, place: ComponentPlan, filled: Target | None) -> None:
    """Register the model with ComfyUI where it now lives, as ComfyUI does after its own loading."""
    if patcher.load_device != _torch_device(filled):
        return  # in RAM, to be loaded where it belongs when a node first uses it
    if filled is not None:
        # The weights were written on the device: say so first, or they would be loaded there a second time.
        partial_model_of(patcher.model).target = filled
        patcher._sync_books(patcher.load_device)
    # Where ComfyUI manages the device, the weights are there already and must stay in full; elsewhere our
    # patcher loads them now within the placement's budget.
    makes_room = place.target is None or backend_of(place.target).comfy_makes_room
    mm.load_models_gpu([patcher], force_full_load=makes_room)


def _is_cuda(device: torch.device | None) -> bool:
    return device is not None and device.type == "cuda"
