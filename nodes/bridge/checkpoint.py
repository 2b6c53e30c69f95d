"""Build a checkpoint's MODEL, CLIP and VAE with ComfyUI's own classes, and fill them our way.

ComfyUI's ``load_state_dict_guess_config`` reads the whole file, builds each model in its compute dtype and
copies the weights in, so for a while both are in memory. Here the same ComfyUI steps run on stand-ins
(``core.lineage``): the models are built with their parameters on ``meta`` and ComfyUI's own key renames and
value transforms run without touching a weight, which tells us, for every tensor of every model, where it
comes from in the file. Then each parameter is allocated once, in the dtype ComfyUI chose for it and on the
device we chose, and streamed from the file (``core.skeleton``). The result is what ComfyUI builds, tensor
for tensor, at a fraction of the peak memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...core.detection import Detection
from ...core.errors import ModelFileError, UnknownModelError
from ...core.headers import FileHeader
from ...core.lineage import Tracer, capture_state_dict_loads, source_of, source_tensors
from ...core.loading import Placement, partial_model_of
from ...core.ops import convert
from ...core.simulated import SimulatedDevice
from ...core.skeleton import Source, materialize, weights_on_meta
from ...core.weights import ProgressCallback, WeightReader
from .. import surface
from .patcher import DeviceControlPatcher, adopt
from .reading import dominant_dtype

log = logging.getLogger("device_control")

#: Tensors ComfyUI reads by value while it builds a model (not just by shape): read for real, they are small.
VALUE_PROBES = (
    "output_blocks.11.1.transformer_blocks.0.norm1.bias",  # SD2 tells eps from v-prediction by its spread
    "edm_vpred.sigma_max",
    "edm_vpred.sigma_min",
    "cc_projection.weight",
    "cc_projection.bias",
    "spiece_model",
    "tekken_model",
)


@dataclass(frozen=True)
class ComponentPlan:
    """Where one component goes: ComfyUI's torch device, and a simulated device when that is the target.

    ``device`` ``None`` means ComfyUI's own default; ``dtype`` ``None`` means ComfyUI's own choice.
    ``fits`` says whether the weights can be written straight onto a real accelerator (the fit plan's
    verdict); when not, they are written to host memory and loaded, as far as they fit, when used.
    ``placement`` is what the component's patcher carries from then on (``None``: ComfyUI decides).
    """

    device: torch.device | None = None
    simulated: SimulatedDevice | None = None
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
    mm, utils = surface.model_management(), surface.comfy_utils()
    roles = ("diffusion_model", "text_encoder", "vae")
    unet, clip_place, vae_place = (placements.get(role, ComponentPlan()) for role in roles)
    notes: list[str] = []
    with WeightReader(header, pin_staging=any(_is_cuda(p.device) for p in placements.values())) as reader:
        sd = source_tensors(header.tensors, _probes(header, reader))
        metadata = dict(header.metadata)
        prefix = surface.model_detection().unet_prefix_from_state_dict(sd)
        config = surface.model_detection().model_config_from_unet(sd, prefix, metadata=metadata)
        if config is None or type(config).__name__ != detection.comfy_class:
            found = type(config).__name__ if config is not None else "nothing"
            raise UnknownModelError(
                f"ComfyUI builds {found} from {header.path}, but the header says {detection.comfy_class}; "
                "load it with ComfyUI's Load Checkpoint instead, and report the file's layout."
            )
        compute = unet.device or mm.get_torch_device()
        cast_device = torch.device("cpu") if unet.simulated is not None else compute
        dtype = unet.dtype or mm.unet_dtype(  # the same choice default_dtype() made for the fit plan
            device=cast_device,
            model_params=utils.calculate_parameters(sd, prefix),
            supported_dtypes=config.supported_inference_dtypes,
            weight_dtype=utils.weight_dtype(sd, prefix),
        )
        config.set_inference_dtype(dtype, mm.unet_manual_cast(dtype, cast_device, config.supported_inference_dtypes))

        # Weights are created on meta while ComfyUI builds the models (values it constructs stay real), and
        # ComfyUI's own renames and transforms run on the stand-ins, traced.
        with capture_state_dict_loads() as captured, weights_on_meta():
            model = config.get_model(sd, prefix, device=torch.device("cpu"))
            with Tracer():  # only the steps that rename and transform weights need tracing
                model.load_model_weights(sd, prefix)
                vae_sd = config.process_vae_state_dict(
                    utils.state_dict_prefix_replace(sd, dict.fromkeys(config.vae_key_prefix, ""), filter_keys=True)
                )
                vae = surface.comfy_sd().VAE(
                    sd=vae_sd, device=vae_place.device, dtype=vae_place.dtype, metadata=metadata
                )
                clip = _build_clip(config, sd, clip_place)

        roots = {"model": model, "vae": vae.first_stage_model}
        if clip is not None:
            roots["clip"] = clip.cond_stage_model
        sources = _sources(captured, roots, reader.read)
        total = sum(p.numel() * p.element_size() for root in roots.values() for p in root.parameters())
        done = 0

        def step(module_done: int, _module_total: int) -> None:
            if progress is not None:
                progress(done + module_done, total)

        fill = {"model": _fill_device(unet), "clip": _fill_device(clip_place), "vae": torch.device("cpu")}
        for name, root in roots.items():
            plan = _with_exact_names(root, sources[name], header)
            try:
                result = materialize(root, plan, reader, fill[name], progress=step)
            except torch.OutOfMemoryError:  # the device filled up meanwhile (another process, fragmentation)
                log.warning(
                    "[Device Control] %s did not fit on %s after all; loading it to RAM instead, ComfyUI "
                    "will load what fits when it is used",
                    name,
                    fill[name],
                )
                notes.append(f"{name}: did not fit on {fill[name]}; loaded to RAM, ComfyUI loads what fits when used")
                mm.soft_empty_cache()
                fill[name] = torch.device("cpu")
                result = materialize(root, plan, reader, fill[name], progress=step)
            done += result.loaded_bytes
            real_missing = [k for k in result.missing if not k.endswith("text_projection.weight")]
            if real_missing:
                notes.append(
                    f"{name}: {len(real_missing)} weights are not in the file and start at zero "
                    f"(e.g. {real_missing[0]})"
                )
    model.device = fill["model"]
    for root in roots.values():  # ComfyUI's standard layers become ours: casts and patches run our code
        convert(root, accept=_is_comfy_layer)
    patcher = DeviceControlPatcher(
        model, load_device=cast_device if unet.simulated else compute, offload_device=mm.unet_offload_device()
    )
    patcher.device_control_placement = unet.placement
    if clip is not None:
        adopt(clip.patcher, clip_place.placement)
    adopt(vae.patcher, vae_place.placement)
    _first_load(mm, patcher, unet, fill["model"])
    if clip is not None:
        _first_load(mm, clip.patcher, clip_place, fill["clip"])
    return BuiltCheckpoint(patcher, clip, vae, notes)


_STORED = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def default_dtype(role: str, device: torch.device, detection: Detection) -> torch.dtype:
    """The storage dtype ComfyUI picks for ``role`` on ``device`` (its ``unet_dtype`` and friends)."""
    mm = surface.model_management()
    if role == "diffusion_model":
        unet = detection.component("diffusion_model")[0]
        family = getattr(surface.supported_models(), detection.comfy_class)
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


def _probes(header: FileHeader, reader: WeightReader) -> dict[str, torch.Tensor]:
    wanted = [name for name in header.tensors if any(name.endswith(probe) for probe in VALUE_PROBES)]
    return {name: reader.read(name) for name in wanted if header.tensors[name].nbytes < 64 * 1024**2}


def _build_clip(config: Any, sd: dict, place: Placement) -> Any:
    target = config.clip_target(state_dict=sd)
    if target is None:
        return None
    clip_sd = config.process_clip_state_dict(sd)
    if not clip_sd:
        return None
    # Built on the host (its weights on meta, see weights_on_meta). "cpu:0" is the host, but not equal to "cpu":
    # so ComfyUI skips the first load it makes when the build device is the load device; we make it later.
    options: dict[str, Any] = {"initial_device": torch.device("cpu", 0)}
    if place.device is not None:
        options |= {"load_device": place.device, "offload_device": torch.device("cpu")}
    if place.dtype is not None:
        options["dtype"] = place.dtype
    folders = surface.folder_paths()
    clip = surface.comfy_sd().CLIP(
        target,
        embedding_directory=folders.get_folder_paths("embeddings"),
        tokenizer_data=clip_sd,
        parameters=surface.comfy_utils().calculate_parameters(clip_sd),
        model_options=options,
    )
    clip.load_sd(clip_sd, full_model=True)
    return clip


def _sources(captured: list, roots: dict[str, torch.nn.Module], read: Callable[[str], torch.Tensor]) -> dict:
    """Turn what each module would have been given into sources, keyed by the module's own names."""
    paths = {id(module): (name, path) for name, root in roots.items() for path, module in root.named_modules()}
    sources: dict[str, dict[str, Source]] = {name: {} for name in roots}
    for module, state in captured:
        owner = paths.get(id(module))
        if owner is None:
            continue
        root, path = owner
        for key, value in state.items():
            source = source_of(value, read)
            if source is None:
                raise ModelFileError(
                    f"ComfyUI computes {key!r} in a way Device Control cannot stream; load this file with "
                    "ComfyUI's Load Checkpoint."
                )
            sources[root][f"{path}.{key}" if path else key] = source
    return sources


def _with_exact_names(root: torch.nn.Module, sources: dict[str, Source], header: FileHeader) -> dict[str, Source]:
    """Parameters a model copies in while it is built (not through ``load_state_dict``) keep their file name."""
    extra = {name: name for name, _ in root.named_parameters() if name not in sources and name in header.tensors}
    return {**sources, **extra}


def _fill_device(place: ComponentPlan) -> torch.device:
    """Where weights are first written: a real accelerator they fit on, else host memory.

    (The VAE is always written to host memory: ComfyUI moves it to its device when it decodes.)
    """
    if place.device is not None and place.simulated is None and place.device.type != "cpu" and place.fits:
        return place.device
    return torch.device("cpu")


def _first_load(mm: Any, patcher: Any, place: ComponentPlan, filled_on: torch.device) -> None:
    """Register the model with ComfyUI where it now lives, as ComfyUI does after its own loading."""
    if place.simulated is None and patcher.load_device != filled_on:
        return  # in RAM, to be loaded where it belongs when a node first uses it
    if filled_on.type != "cpu":
        # The weights were written on the device: say so first, or ComfyUI would make room for them twice.
        partial_model_of(patcher.model).target = filled_on
        patcher._sync_books(filled_on)
    mm.load_models_gpu([patcher], force_full_load=place.simulated is None)


def _is_cuda(device: torch.device | None) -> bool:
    return device is not None and device.type == "cuda"
