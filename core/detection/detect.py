"""What a model file is, from its header alone, and whether it fits: the API and the command line.

    python -m core.detection FILE [--json] [--device ROLE=DEVICE[:DTYPE] ...]

:func:`detect` reads only the header (names, shapes, dtypes; never a weight), decides the kind of file
(checkpoint, diffusion model, VAE, text encoder, LoRA), the family and the ``comfy.supported_models`` class
ComfyUI would build, the variant and prediction type, and weighs every component in every candidate dtype.
When nothing matches it says so, with the closest candidates and why each failed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from os import PathLike
from typing import Any

from .branches import BRANCHES, Branch, find_branch
from .components import Component, measure, text_encoder_kind, vae_kind
from .diffusers_branches import DIFFUSERS_BRANCHES, DIFFUSERS_UNETS
from .family_table import FAMILIES, Family, match_family
from .headers import FileHeader, TensorInfo, read_header
from .keyview import KeyView
from .lora_info import LoraInfo, describe_lora, is_lora

DIFFUSION_PREFIXES = ("model.diffusion_model.", "model.model.", "net.")
#: How the GGML project's converters name a language model's tensors (a text encoder's, in a GGUF file).
LLAMA_CPP_NAMES = ("token_embd.", "blk.0.", "enc.blk.0.")
#: How such a file's family reads where its names are not mapped to ComfyUI's (``gguf_names``).
LLAMA_CPP_NAMED = "llama.cpp tensor names"
TEXT_ENCODER_CONTAINERS = ("text_encoders.", "conditioner.embedders.", "cond_stage_model.", "text_encoder.")


@dataclass(frozen=True)
class Detection:
    """Everything :func:`detect` found out about a file.

    ``kind`` is ``checkpoint``, ``diffusion_model``, ``vae``, ``text_encoder``, ``lora`` or ``unknown``;
    ``comfy_class`` is the ``comfy.supported_models`` class name for checkpoints and diffusion models;
    ``reason`` and ``candidates`` explain an ``unknown``.
    """

    path: str
    file_format: str
    kind: str
    family: str | None = None
    comfy_class: str | None = None
    model_type: str | None = None
    variants: tuple[str, ...] = ()
    prefix: str = ""
    components: tuple[Component, ...] = ()
    config: Mapping[str, Any] = field(default_factory=dict)
    lora: LoraInfo | None = None
    reason: str | None = None
    candidates: tuple[str, ...] = ()
    seconds: float = 0.0

    def component(self, role: str) -> list[Component]:
        """Components whose name is ``role`` or starts with ``role:`` (``text_encoder`` gives every encoder)."""
        return [c for c in self.components if c.name == role or c.name.startswith(role + ":")]


def detect(path: str | PathLike[str]) -> Detection:
    """Detect what the model file at ``path`` is, from its header.

    Raises:
        ModelFileError: the file is missing, empty, a directory, damaged, or of a format we do not read.
        UnsafePickleError: a pickle that ``weights_only`` refuses.
    """
    started = time.perf_counter()
    header = read_header(path, gguf=True)
    found = detect_header(header)
    return Detection(**{**found.__dict__, "seconds": time.perf_counter() - started})


def detect_header(header: FileHeader) -> Detection:
    """Detect from an already read header (see :func:`detect`)."""
    tensors = header.tensors
    base = {"path": header.path, "file_format": header.format}
    if is_lora(tensors):
        info = describe_lora(tensors)
        family = f"LoRA for {info.target_family}" if info.target_family else "LoRA (target model unknown)"
        return Detection(
            **base,
            kind="lora",
            family=family,
            lora=info,
            components=(measure("lora", "LoRA", "", list(tensors.values())),),
        )
    model = _diffusion_model(header)
    if model is not None:
        return Detection(**base, **model)
    if header.format == "gguf" and any(name.startswith(LLAMA_CPP_NAMES) for name in tensors):
        architecture = header.metadata.get("general.architecture", "unnamed")
        return single_component(header, "text_encoder", f"{architecture} text encoder, {LLAMA_CPP_NAMED}")
    for kind, classify in (("vae", vae_kind), ("text_encoder", text_encoder_kind)):
        name = classify(KeyView(tensors, ""))
        if name is not None:
            return single_component(header, kind, name)
    return Detection(**base, kind="unknown", **_explain_unknown(tensors))


def single_component(header: FileHeader, kind: str, name: str) -> Detection:
    """The file described as one component of ``kind`` (``vae``, ``text_encoder``) named ``name``: a file of a
    VAE or a text encoder, which another source may have identified (ComfyUI's own detection)."""
    return Detection(
        path=header.path,
        file_format=header.format,
        kind=kind,
        family=name,
        components=(measure(kind, name, "", list(header.tensors.values())),),
    )


def detection_for(header: FileHeader, family: Family, prefix: str) -> Detection:
    """The file described as a model of ``family`` whose diffusion model sits under ``prefix``.

    For a family that another source identified (ComfyUI's own detection, for a class our table lacks): the
    components are found and weighed as for any detected file, so plans and reports work the same.
    """
    components = _components(header.tensors, prefix, family)
    whole = KeyView(header.tensors, prefix)
    return Detection(
        path=header.path,
        file_format=header.format,
        kind=_kind(components),
        family=family.name,
        comfy_class=family.comfy_class,
        model_type=family.type_of(whole),
        variants=_variants(family, {}, whole, header, diffusers=False),
        prefix=prefix,
        components=components,
    )


def diffusion_prefix(tensors: Mapping[str, TensorInfo]) -> str:
    """The key prefix of the diffusion model: the most common known prefix, else ``model.``."""
    counts = dict.fromkeys(DIFFUSION_PREFIXES, 0)
    for name in tensors:
        for prefix in DIFFUSION_PREFIXES:
            if name.startswith(prefix):
                counts[prefix] += 1
                break
    best = max(counts, key=counts.__getitem__)  # ties go to the earlier prefix
    return best if counts[best] > 5 else "model."


def _diffusion_model(header: FileHeader) -> dict[str, Any] | None:
    tensors = header.tensors
    prefix = diffusion_prefix(tensors)
    whole = KeyView(tensors, prefix, header.metadata)
    hit = _match(whole, BRANCHES)
    if hit is None:  # as a diffusion-model-only file: the prefix stripped, every other key dropped
        stripped = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        if not stripped:  # a bare diffusion model: its keys carry no prefix at all
            stripped, prefix = dict(tensors), ""
        view = KeyView(stripped, "", header.metadata)
        hit = _match(view, BRANCHES) or _match(view, DIFFUSERS_BRANCHES, diffusers=True)
        if hit is None:
            return None
        whole = KeyView(tensors, prefix, header.metadata)
    family, fields, diffusers = hit
    components = _components(tensors, whole.prefix, family)
    return {
        "kind": _kind(components),
        "family": family.name,
        "comfy_class": family.comfy_class,
        "model_type": family.type_of(whole),
        "variants": _variants(family, fields, whole, header, diffusers),
        "prefix": whole.prefix,
        "components": components,
        "config": fields,
    }


def _kind(components: tuple[Component, ...]) -> str:
    """A checkpoint holds more than the diffusion model (a VAE or text encoder); else a diffusion model."""
    return (
        "checkpoint"
        if any(c.name != "diffusion_model" and c.kind != "other" for c in components)
        else "diffusion_model"
    )


def _match(view: KeyView, branches: tuple[Branch, ...], diffusers: bool = False) -> tuple[Family, dict, bool] | None:
    branch = find_branch(view, branches)
    fields = branch.fields(view) if branch is not None else None
    if fields is None:
        return None
    family = match_family(branch, fields, view)
    if family is None or (
        diffusers and branch.name == "unet" and (family.comfy_class, fields["in_channels"]) not in DIFFUSERS_UNETS
    ):
        return None
    return family, fields, diffusers


class _Grouping:
    """Tensors of a file sorted into components, each tensor in the first component that takes it."""

    def __init__(self, tensors: Mapping[str, TensorInfo]) -> None:
        self.remaining = dict(tensors)
        self.groups: dict[str, list[TensorInfo]] = {}
        self.kinds: dict[str, tuple[str, str]] = {}

    def take(self, name: str, kind: str, stem: str) -> None:
        """Every remaining tensor under ``stem`` goes to component ``name`` of ``kind``."""
        chosen = [t for key, t in self.remaining.items() if key.startswith(stem)]
        for info in chosen:
            del self.remaining[info.name]
        if chosen:
            self.groups.setdefault(name, []).extend(chosen)
            self.kinds.setdefault(name, (kind, stem))

    def components(self) -> tuple[Component, ...]:
        """The components, and what no component took (tensors with data) as ``other``."""
        leftover = [t for t in self.remaining.values() if t.numel > 0]
        if leftover:
            self.groups["other"] = leftover
            self.kinds["other"] = ("other", "")
        return tuple(measure(name, *self.kinds[name], infos) for name, infos in self.groups.items())


def _components(tensors: Mapping[str, TensorInfo], prefix: str, family: Family) -> tuple[Component, ...]:
    grouping = _Grouping(tensors)
    grouping.take("diffusion_model", family.name, prefix)
    vae = vae_kind(KeyView(tensors, family.vae_prefix)) if family.vae_prefix else None
    if vae is not None:
        grouping.take("vae", vae, family.vae_prefix)
    for container in TEXT_ENCODER_CONTAINERS:
        _take_text_encoders(grouping, tensors, container)
    return grouping.components()


def _take_text_encoders(grouping: _Grouping, tensors: Mapping[str, TensorInfo], container: str) -> None:
    """The text encoders under ``container`` (each in a numbered slot, or the container itself)."""
    slots = sorted({key[len(container) :].split(".", 1)[0] for key in grouping.remaining if key.startswith(container)})
    found = None
    for stem in [f"{container}{slot}." for slot in slots] + [container]:
        encoder = text_encoder_kind(KeyView(tensors, stem))
        if encoder is not None and any(k.startswith(stem) for k in grouping.remaining):
            found = f"text_encoder:{_slot_name(encoder)}"
            grouping.take(found, encoder, stem)
    if found is not None:  # tokenizer blobs and scalars beside the encoders belong to them
        grouping.take(found, grouping.kinds[found][0], container)


def _slot_name(encoder: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", encoder.lower()).strip("_")


def _v_prediction(family: Family, view: KeyView) -> bool:
    model_type = family.type_of(view)
    return model_type.startswith("V_PREDICTION") and family.model_type != model_type


#: Variants told from the family, its configuration and its keys.
_VARIANTS: tuple[tuple[str, Callable[[Family, Mapping[str, Any], KeyView], bool]], ...] = (
    ("inpaint", lambda f, c, v: (f.branch == "unet" and c.get("in_channels") == 9) or f.comfy_class == "FluxInpaint"),
    ("depth", lambda f, c, v: f.branch == "unet" and c.get("in_channels") == 5),
    ("instruct-pix2pix", lambda f, c, v: "instructpix2pix" in f.comfy_class),
    ("refiner", lambda f, c, v: "Refiner" in f.comfy_class),
    ("v-prediction", lambda f, c, v: _v_prediction(f, v)),
    ("zero terminal SNR", lambda f, c, v: v.root_has("ztsnr")),
)


def _variants(family: Family, fields: Mapping[str, Any], view: KeyView, header: FileHeader, diffusers: bool) -> tuple:
    variants = [name for name, applies in _VARIANTS if applies(family, fields, view)]
    scaled = view.dtype("scaled_fp8")
    if scaled is not None:
        variants.append(f"scaled fp8 ({'e5m2' if scaled == 'F8_E5M2' else 'e4m3fn'})")
    if "_quantization_metadata" in header.metadata:
        variants.append("mixed-precision quantized layers")
    if diffusers:
        variants.append("diffusers names")
    return tuple(variants)


def _explain_unknown(tensors: Mapping[str, TensorInfo]) -> dict[str, Any]:
    """Why nothing matched: which architecture the keys resemble, and what each close family lacks."""
    if not tensors:
        return {"reason": "the file holds no tensors", "candidates": ()}
    prefix = diffusion_prefix(tensors)
    for view in (KeyView(tensors, prefix), KeyView(tensors, "")):
        near = _near_families(view)
        if near is not None:
            return near
    stems = _markers_elsewhere(tensors)
    if stems:
        near = tuple(f"{name}: marker found under the unknown prefix {stem!r}" for name, stem in stems.items())
        return {"reason": "architecture markers sit under a key prefix no loader uses", "candidates": near}
    top = sorted({name.split(".", 1)[0] for name in tensors})[:8]
    return {"reason": f"no known architecture marker; top-level key groups: {', '.join(top)}", "candidates": ()}


def _near_families(view: KeyView) -> dict[str, Any] | None:
    """The families of the architecture ``view``'s keys are of, closest first, with what each lacks."""
    branch = find_branch(view)
    fields = branch.fields(view) if branch is not None else None
    if not fields:
        return None
    related = sorted(
        ((f.mismatches(fields, view), f) for f in FAMILIES if f.branch == branch.name),
        key=lambda pair: len(pair[0]),  # closest first: fewest differences
    )
    return {
        "reason": f"the keys are of the {branch.name} architecture, but no known family of it matches",
        "candidates": tuple(f"{f.comfy_class}: {'; '.join(reasons)}" for reasons, f in related[:5]),
        "config": fields,
    }


def _markers_elsewhere(tensors: Mapping[str, TensorInfo]) -> dict[str, str]:
    """Architecture markers found at the end of keys under a prefix we do not know: branch -> that prefix."""
    stems = {}
    for branch in BRANCHES:
        marker = branch.markers[0]
        found = next((name for name in tensors if name.endswith("." + marker)), None)
        if found is not None:
            stems[branch.name] = found[: -len(marker)]
    return stems
