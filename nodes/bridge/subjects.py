"""What a value on a wire is (a MODEL, a CLIP, a VAE, a ControlNet, a CLIP vision model, an upscale model, a model
patch or GLIGEN, and the patcher behind it), and what to call it.

One classification and one label for the whole pack: the VRAM Report, Move To GPU, Offload To CPU, the books
and the patcher's log lines all name a model the same way. Values are told apart by what they hold, the same on
every ComfyUI tested: a MODEL, a model patch and GLIGEN are patchers themselves (of a diffusion model, of another
module, of a GLIGEN module); a CLIP, a VAE and a CLIP vision model hold one (``patcher``); a ControlNet holds its
patcher in ``control_model_wrapped``; an upscale model is spandrel's descriptor, given a patcher from ComfyUI 0.33.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...core.errors import DeviceControlError
from .. import surface

#: What each kind of value is called in texts (a MODEL, CLIP or VAE is named by its model: ``model_label``).
KIND_NOUNS = {
    "CONTROL_NET": "ControlNet",
    "CLIP_VISION": "CLIP vision model",
    "UPSCALE_MODEL": "upscale model",
    "MODEL_PATCH": "model patch",
    "GLIGEN": "GLIGEN model",
}
#: The kinds Move To GPU, Offload To CPU and the VRAM Report take, as ComfyUI types them.
PLACEABLE_KINDS = ("MODEL", "CLIP", "VAE", *KIND_NOUNS)


@dataclass
class Subject:
    """A value of one of :data:`PLACEABLE_KINDS` and the ModelPatcher behind it (for a MODEL, a model patch or
    GLIGEN, the value itself)."""

    kind: str
    value: Any
    patcher: Any

    @property
    def name(self) -> str:
        """``SD15 diffusion model``, ``text encoder (SD1ClipModel)``, ``ControlNet (ControlNet)``."""
        noun = KIND_NOUNS.get(self.kind)
        if noun is None:
            return model_label(self.patcher)
        return f"{noun} ({type(self.patcher.model).__name__})"


def _is_patcher(value: Any) -> bool:
    return hasattr(value, "model_size") and hasattr(value, "loaded_size") and hasattr(value, "model")


def _is_upscale_model(value: Any) -> bool:
    """spandrel's ``ImageModelDescriptor``: an architecture, a scale and a module (ComfyUI 0.33 adds a patcher)."""
    return all(hasattr(value, name) for name in ("architecture", "scale", "size_requirements", "model"))


def _is_diffusion_model(model: Any) -> bool:
    base = surface.base_model_class()
    return (base is not None and isinstance(model, base)) or hasattr(model, "diffusion_model")


def subject_of(value: Any) -> Subject | None:
    """Tell the kinds of :data:`PLACEABLE_KINDS` apart (``None`` for anything else, or for one of them without a
    patcher: :func:`require_subject` says why)."""
    if _is_upscale_model(value):  # before the rules on ``patcher``: ComfyUI 0.33's descriptor has one
        patcher = getattr(value, "patcher", None)
        return Subject("UPSCALE_MODEL", value, patcher) if _is_patcher(patcher) else None
    if _is_patcher(value):
        if _is_diffusion_model(value.model):
            return Subject("MODEL", value, value)
        return Subject("GLIGEN" if hasattr(value.model, "set_position") else "MODEL_PATCH", value, value)
    wrapped = getattr(value, "control_model_wrapped", None)
    if _is_patcher(wrapped):
        return Subject("CONTROL_NET", value, wrapped)
    return _holding_a_patcher(value)


def _holding_a_patcher(value: Any) -> Subject | None:
    """A CLIP, a VAE or a CLIP vision model: each holds its patcher in ``patcher``."""
    patcher = getattr(value, "patcher", None)
    if not _is_patcher(patcher):
        return None
    if hasattr(value, "cond_stage_model"):
        return Subject("CLIP", value, patcher)
    if hasattr(value, "first_stage_model"):
        return Subject("VAE", value, patcher)
    if hasattr(value, "encode_image"):
        return Subject("CLIP_VISION", value, patcher)
    return None


def require_subject(value: Any) -> Subject:
    """:func:`subject_of` for a node input that must be a model.

    Raises:
        DeviceControlError: the value is none of :data:`PLACEABLE_KINDS`, or one whose model ComfyUI moves itself
            at each use (no patcher to carry a placement), with what to do instead.
    """
    subject = subject_of(value)
    if subject is not None:
        return subject
    name = type(value).__name__
    if _is_upscale_model(value):
        raise DeviceControlError(
            f"this ComfyUI ({surface.comfyui_version()}) gives an upscale model no ModelPatcher: its Upscale Image "
            "(using Model) node moves the model to its own device at each use and back to the CPU after, so a "
            "placement would not hold. Use Upscale Image With Device instead, which places it where it computes "
            "(from ComfyUI 0.33 on, Move To GPU places it too)."
        )
    if hasattr(value, "get_control") and hasattr(value, "set_cond_hint"):
        raise DeviceControlError(
            f"a {name} builds or moves its model itself each time it is used (no ModelPatcher to carry a "
            "placement), so it cannot be placed; a ControlNet loaded by Load ControlNet Model can."
        )
    raise DeviceControlError(
        f"a {name} cannot be moved: connect a MODEL, CLIP, VAE, CONTROL_NET, CLIP_VISION, UPSCALE_MODEL, "
        "MODEL_PATCH or GLIGEN to the model input."
    )


#: Where the module of each other kind is defined (a part of its class's ``__module__``, first match wins).
#: ComfyUI's list of loaded models holds the module, not the value a loader gave out, so a ControlNet the sampler
#: loaded is told from a CLIP vision model by where its class lives: ComfyUI's own files, or spandrel's for upscale
#: models. ComfyUI imports its ``comfy_extras`` files by their bare names (``nodes_model_patch``).
_HOMES = (
    ("spandrel.", "UPSCALE_MODEL"),
    ("comfy.gligen", "GLIGEN"),
    ("nodes_model_patch", "MODEL_PATCH"),
    ("comfy.clip_model", "CLIP_VISION"),
    ("comfy.cldm.", "CONTROL_NET"),
)


def component_of(model: Any) -> str:
    """``MODEL``, ``CLIP`` or ``VAE`` from what ComfyUI's module tree can do; one of :data:`KIND_NOUNS` from where
    its class is defined; else ``other``."""
    base = surface.base_model_class()
    if base is not None and isinstance(model, base):
        return "MODEL"
    if hasattr(model, "encode_token_weights"):
        return "CLIP"
    if hasattr(model, "decode") and hasattr(model, "encode"):
        return "VAE"
    return _kind_by_home(type(model).__module__ or "")


def _kind_by_home(home: str) -> str:
    """One of :data:`KIND_NOUNS` from the module a class is defined in (:data:`_HOMES`), else ``other``."""
    if home.startswith("comfy.ldm.") and "controlnet" in home:  # Flux's, HunYuan-DiT's, Cascade's ControlNets
        return "CONTROL_NET"
    return next((kind for part, kind in _HOMES if part in home), "other")


_NOUNS = {"MODEL": "diffusion model", "CLIP": "text encoder", "VAE": "VAE", **KIND_NOUNS}


def model_label(patcher: Any, *, with_class: bool = True) -> str:
    """What users call a patcher's model: ``SD15 diffusion model``, ``text encoder (SD1ClipModel)``,
    ``ControlNet (ControlNet)``.

    Args:
        patcher: a ModelPatcher.
        with_class: name the module class after a text encoder or a VAE (reports show it in a field of its own).
    """
    model = patcher.model
    config = getattr(model, "model_config", None)
    if config is not None:
        return f"{type(config).__name__} diffusion model"
    noun = _NOUNS.get(component_of(model))
    if noun is None:
        return type(model).__name__
    return f"{noun} ({type(model).__name__})" if with_class else noun
