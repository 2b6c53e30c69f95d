"""What a value on a wire is (a MODEL, a CLIP or a VAE, and the patcher behind it), and what to call it.

One classification and one label for the whole pack: the VRAM Report, Move To GPU, Offload To CPU, the books
and the patcher's log lines all name a model the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...core.errors import DeviceControlError
from .. import surface


@dataclass
class Subject:
    """A MODEL, CLIP or VAE value and the ModelPatcher behind it (for a MODEL, the value itself)."""

    kind: str
    value: Any
    patcher: Any

    @property
    def name(self) -> str:
        """``SD15 diffusion model``, ``text encoder (SD1ClipModel)``, ``VAE (AutoencoderKL)``."""
        return model_label(self.patcher)


def subject_of(value: Any) -> Subject | None:
    """Tell a MODEL, a CLIP and a VAE apart (``None`` for anything else)."""
    if hasattr(value, "model_size") and hasattr(value, "loaded_size") and hasattr(value, "model"):
        return Subject("MODEL", value, value)
    patcher = getattr(value, "patcher", None)
    if patcher is None or not hasattr(patcher, "model_size"):
        return None
    if hasattr(value, "cond_stage_model"):
        return Subject("CLIP", value, patcher)
    if hasattr(value, "first_stage_model"):
        return Subject("VAE", value, patcher)
    return None


def require_subject(value: Any) -> Subject:
    """:func:`subject_of` for a node input that must be a model.

    Raises:
        DeviceControlError: the value is no MODEL, CLIP or VAE.
    """
    subject = subject_of(value)
    if subject is None:
        raise DeviceControlError(
            f"a {type(value).__name__} cannot be moved: connect a MODEL, a CLIP or a VAE to the model input."
        )
    return subject


def component_of(model: Any) -> str:
    """``MODEL``, ``CLIP``, ``VAE`` or ``other``, from what ComfyUI's module tree can do."""
    base = surface.base_model_class()
    if base is not None and isinstance(model, base):
        return "MODEL"
    if hasattr(model, "encode_token_weights"):
        return "CLIP"
    if hasattr(model, "decode") and hasattr(model, "encode"):
        return "VAE"
    return "other"


_NOUNS = {"MODEL": "diffusion model", "CLIP": "text encoder", "VAE": "VAE"}


def model_label(patcher: Any, *, with_class: bool = True) -> str:
    """What users call a patcher's model: ``SD15 diffusion model``, ``text encoder (SD1ClipModel)``.

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
