"""How a model's weights are stored: bytes per dtype, or per GGML type for quantised blocks (ours and another
pack's), so that a GGUF model is not called ``uint8``. Plain torch-module accounting, kept per module because the
panel asks every second; read by the loaders' texts, the VAE and text-encoder dtype checks and the panel.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

from ...core.detection.ggml_types import ggml_type, storage_label
from ...core.errors import ModelFileError
from ...core.weights.foreign import is_foreign_quantized
from ...core.weights.quantized import layout_of

#: The attribute of a model built from a GGUF file naming the file's type (``Q4_K_M``, from ``general.file_type``).
GGUF_FILE_TYPE = "device_control_gguf_file_type"


def storage_bytes(module: Any) -> dict[str, int]:
    """The bytes of a module's weights by how they are stored: a dtype (``float16``), or a GGML type (``Q8_0``)
    for quantised blocks (ours, ``core.weights.quantized``, or ComfyUI-GGUF's), so a GGUF model is not called
    ``uint8``."""
    sizes: dict[str, int] = {}
    seen: set[int] = set()
    for owner in module.modules():
        for name, param in owner.named_parameters(recurse=False):
            if id(param) in seen:  # a tied weight, counted once
                continue
            seen.add(id(param))
            kind = _stored_as(owner, name, param)
            sizes[kind] = sizes.get(kind, 0) + param.numel() * param.element_size()
    return sizes


def _stored_as(owner: Any, name: str, param: Any) -> str:
    """``Q8_0`` for our quantised blocks and another pack's (ComfyUI-GGUF's), else the dtype's name."""
    layout = layout_of(owner, name)
    if layout is not None:
        return layout.kind.name
    if is_foreign_quantized(param) and param.tensor_type is not None:
        try:
            return ggml_type(int(param.tensor_type)).name
        except ModelFileError:
            return f"GGML type {int(param.tensor_type)}"
    return str(param.dtype).replace("torch.", "")


def dominant_storage(module: Any) -> str | None:
    """How most of a module's weight bytes are stored (:func:`storage_bytes`; ``None`` for a module without
    weights)."""
    sizes = kept_sizes(module)
    return max(sizes, key=sizes.__getitem__) if sizes else None


def kept_sizes(module: Any) -> dict[str, int]:
    """:func:`storage_bytes`, kept per module (the panel asks every second); a conversion forgets it
    (:func:`forget_dtype`)."""
    try:
        return _sizes[module]
    except (KeyError, TypeError):
        pass
    sizes = storage_bytes(module)
    with contextlib.suppress(TypeError):  # an object that cannot be weakly referenced is asked each time
        _sizes[module] = sizes
    return sizes


_sizes: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()


def forget_dtype(module: Any) -> None:
    """Forget what :func:`dominant_storage` kept for ``module`` (its weights were converted: ``bridge.auto_dtype``)."""
    with contextlib.suppress(TypeError):
        _sizes.pop(module, None)


def quantised_label(model: Any) -> str | None:
    """A GGUF model's GGML types (``Q4_K_M: Q4_K/Q6_K blocks, F32 plain``: ``storage_label``); ``None`` for a
    model without quantised blocks."""
    return storage_label(kept_sizes(model), getattr(model, GGUF_FILE_TYPE, None))
