"""A checkpoint's models built with ComfyUI's own classes on stand-ins, and where each weight comes from.

ComfyUI's ``load_state_dict_guess_config`` reads the whole file, builds each model in its compute dtype and
copies the weights in, so for a while both are in memory. Here the same ComfyUI steps run on stand-ins
(``core.files.lineage``): the models are built with their parameters on ``meta``, and ComfyUI's own key
renames and value transforms run without touching a weight, which tells us, for every tensor of every
model, where it comes from in the file (``core.files.skeleton`` then fills them once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ...core.detection.detect import Detection
from ...core.detection.gguf_tokenizer import SPIECE_MODEL, read_tokenizer, tokenizer_from_weights
from ...core.detection.headers import FileHeader
from ...core.errors import ModelFileError, UnknownModelError
from ...core.files.fileset import FileSet, qualified
from ...core.files.lineage import Tracer, capture_state_dict_loads, made_here, source_of, source_tensors
from ...core.files.reader import WeightReader
from ...core.files.skeleton import Source, weights_on_meta
from .. import surface
from .dynamic_vram import layers_with_weights

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


@dataclass
class Traced:
    """ComfyUI's objects built weightless, and the sources of their weights by root (``model``, ``clip``,
    ``vae``) and parameter name."""

    model: Any
    clip: Any
    vae: Any
    sources: dict[str, dict[str, Source]]

    @property
    def roots(self) -> dict[str, torch.nn.Module]:
        """The module trees to fill, by role."""
        roots = {"model": self.model, "vae": self.vae.first_stage_model}
        if self.clip is not None:
            roots["clip"] = self.clip.cond_stage_model
        return roots


@contextmanager
def weightless_build() -> Iterator[list]:
    """Where the pack builds a model with ComfyUI's classes: every weight made on ``meta`` (values ComfyUI constructs
    stay real), every state-dict load captured to trace sources, and ComfyUI's layers made with their weights
    whatever its Dynamic VRAM (:func:`.dynamic_vram.layers_with_weights`). Yields the captured loads."""
    with capture_state_dict_loads() as captured, weights_on_meta(), layers_with_weights():
        yield captured


def config_of(sd: dict, header: FileHeader, detection: Detection) -> tuple[Any, str]:
    """ComfyUI's model config for the stand-in state dict, and the diffusion model's key prefix.

    Raises:
        UnknownModelError: ComfyUI cannot build this file, or builds a different class than detected.
    """
    detect = surface.model_detection()
    prefix = detect.unet_prefix_from_state_dict(sd)
    config = detect.model_config_from_unet(sd, prefix, metadata=dict(header.metadata))
    _require_class(config, header, detection, "Load Checkpoint")
    return config, prefix


def _require_class(config: Any, header: FileHeader, detection: Detection, stock_loader: str) -> None:
    if config is None or type(config).__name__ != detection.comfy_class:
        found = type(config).__name__ if config is not None else "nothing"
        raise UnknownModelError(
            f"ComfyUI builds {found} from {header.path}, but the header says {detection.comfy_class}; "
            f"load it with ComfyUI's {stock_loader} instead, and report the file's layout."
        )


def build_traced(config: Any, sd: dict, prefix: str, header: FileHeader, reader: WeightReader, places: Any) -> Traced:
    """Build the model, the VAE and the text encoder with ComfyUI's classes, weightless, and trace their sources.

    ``places`` gives the VAE's and the text encoder's ``device`` and ``dtype`` (``vae`` and ``clip`` attributes).
    """
    utils = surface.comfy_utils()
    # Weights are created on meta while ComfyUI builds the models (values it constructs stay real), and
    # ComfyUI's own renames and transforms run on the stand-ins, traced.
    with weightless_build() as captured:
        model = config.get_model(sd, prefix, device=torch.device("cpu"))
        with Tracer():  # only the steps that rename and transform weights need tracing
            model.load_model_weights(sd, prefix)
            vae_sd = config.process_vae_state_dict(
                utils.state_dict_prefix_replace(sd, dict.fromkeys(config.vae_key_prefix, ""), filter_keys=True)
            )
            vae = surface.comfy_sd().VAE(
                sd=vae_sd, device=places.vae.device, dtype=places.vae.dtype, metadata=dict(header.metadata)
            )
            clip = _build_clip(config, sd, places.clip)
    traced = Traced(model, clip, vae, {})
    sources = _sources(captured, traced.roots, reader.read)
    traced.sources = {name: _with_exact_names(root, sources[name], header) for name, root in traced.roots.items()}
    return traced


def diffusion_config_of(sd: dict, header: FileHeader, detection: Detection) -> tuple[Any, dict]:
    """ComfyUI's model config for a diffusion-model file's stand-in state dict, and that state dict as ComfyUI's
    Load Diffusion Model keys it (a checkpoint's diffusion-model prefix taken off).

    Raises:
        UnknownModelError: ComfyUI cannot build this file, or builds a different class than detected.
    """
    detect, utils = surface.model_detection(), surface.comfy_utils()
    stripped = utils.state_dict_prefix_replace(sd, {detect.unet_prefix_from_state_dict(sd): ""}, filter_keys=True)
    sd = stripped or sd
    config = detect.model_config_from_unet(sd, "", metadata=dict(header.metadata))
    _require_class(config, header, detection, "Load Diffusion Model")
    return config, sd


def build_traced_model(
    config: Any, sd: dict, header: FileHeader, reader: WeightReader
) -> tuple[Any, dict[str, Source]]:
    """Build the diffusion model of a diffusion-model file with ComfyUI's classes, weightless, and trace the
    sources of its weights (as ComfyUI's Load Diffusion Model builds it)."""
    with weightless_build() as captured:
        model = config.get_model(sd, "", device=torch.device("cpu"))
        with Tracer():
            model.load_model_weights(sd, "")
    sources = _sources(captured, {"model": model}, reader.read)["model"]
    return model, _with_exact_names(model, sources, header)


def stand_ins(header: FileHeader, reader: WeightReader) -> dict:
    """The file as a state dict of tagged ``meta`` tensors (the few ComfyUI reads by value are read for real)."""
    return source_tensors(header.tensors, _probes(header, reader))


def build_traced_text_encoders(files: FileSet, clip_type: Any, options: dict[str, Any]) -> tuple[Any, dict]:
    """The CLIP ComfyUI's CLIP loaders build from ``files`` as ``clip_type`` (a ``comfy.sd.CLIPType``), weightless,
    and the sources of its weights (qualified names of ``files``).

    ComfyUI's own ``load_text_encoder_state_dicts`` runs on the stand-ins, so its choice of encoder classes from
    the type and the files, its key renames and its transforms are the ones a stock loader makes. ``options`` are
    its ``model_options`` (device, offload device, dtype; the build happens on the host, see :func:`_build_clip`).
    """
    sds = [
        source_tensors(reader.header.tensors, _probes(reader.header, reader), partial(qualified, index))
        | _gguf_tokenizer(reader.header)
        for index, reader in enumerate(files.readers)
    ]
    with weightless_build() as captured, Tracer():
        clip = surface.load_text_encoders(sds, clip_type, {"initial_device": torch.device("cpu", 0), **options})
    sources = _sources(captured, {"clip": clip.cond_stage_model}, files.read)["clip"]
    return clip, sources


def build_traced_vae(header: FileHeader, reader: WeightReader, place: Any) -> tuple[Any, dict]:
    """The VAE ComfyUI's Load VAE builds from this file, weightless, on ``place``'s device and in its dtype, and
    the sources of its weights (``place``: a component plan)."""
    with weightless_build() as captured, Tracer():
        vae = surface.comfy_sd().VAE(
            sd=stand_ins(header, reader), device=place.device, dtype=place.dtype, metadata=dict(header.metadata)
        )
    vae.throw_exception_if_invalid()
    sources = _sources(captured, {"vae": vae.first_stage_model}, reader.read)["vae"]
    return vae, _with_exact_names(vae.first_stage_model, sources, header)


def _probes(header: FileHeader, reader: WeightReader) -> dict[str, torch.Tensor]:
    wanted = [name for name in header.tensors if any(name.endswith(probe) for probe in VALUE_PROBES)]
    return {name: reader.read(name) for name in wanted if header.tensors[name].nbytes < 64 * 1024**2}


def _gguf_tokenizer(header: FileHeader) -> dict[str, torch.Tensor]:
    """The tokenizer ComfyUI reads from a UMT5's weights file, for a GGUF that carries it as metadata instead
    (``core.detection.gguf_tokenizer``): as the safetensors file holds it, a byte tensor.

    Raises:
        ModelFileError: the file's tokenizer metadata is broken.
    """
    if header.format != "gguf" or not tokenizer_from_weights(header):
        return {}
    proto = read_tokenizer(header.path)
    if proto is None:  # the loader checked that the file says it has one: its lists are broken
        raise ModelFileError(
            f"{Path(header.path).name}: its tokenizer metadata is incomplete (the pieces, their scores and their "
            "types do not match), so ComfyUI cannot build its tokenizer. Convert the model again, or load its "
            "safetensors file."
        )
    return {SPIECE_MODEL: made_here(torch.frombuffer(bytearray(proto), dtype=torch.uint8))}


def _build_clip(config: Any, sd: dict, place: Any) -> Any:
    """The text encoder ComfyUI builds for this checkpoint (``None`` when it has none), on ``place``'s device and
    in its dtype (``place``: a component plan)."""
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
