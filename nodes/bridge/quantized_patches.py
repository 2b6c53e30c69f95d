"""LoRAs and other patches on a GGUF model's quantised weights (``core.weights.quantized``).

A quantised weight is never patched in place: its blocks would have to be quantised again, which loses the
patch's precision and the original bytes an exact restore needs. Its patches apply on the fly instead, to the
dequantised weight each time it is cast, whether the layer is resident or streamed, with the same patch math as
every other weight (``core.weights.patching.OnTheFlyPatch``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from ...core.weights.patch_math import Patch, calculate_weight
from ...core.weights.patching import OnTheFlyPatch
from ...core.weights.quantized import layout_of


def quantized_owner(model: torch.nn.Module, key: str) -> tuple[torch.nn.Module, str] | None:
    """The layer and parameter name of weight ``key`` when it holds quantised blocks; ``None`` otherwise."""
    path, _, name = key.rpartition(".")
    try:
        owner = model.get_submodule(path) if path else model
    except AttributeError:
        return None
    return (owner, name) if layout_of(owner, name) is not None else None


def attach(owner: torch.nn.Module, name: str, patch: OnTheFlyPatch) -> None:
    """Apply ``patch`` to ``owner``'s parameter ``name`` each time it is cast (once, however often asked)."""
    attribute = f"{name}_function"
    functions = list(owner.__dict__.get(attribute, ()))
    if not any(isinstance(f, OnTheFlyPatch) and f.key == patch.key for f in functions):
        setattr(owner, attribute, [*functions, patch])


def detach(owner: torch.nn.Module, keys: Iterable[str]) -> None:
    """Take the on-the-fly patches of ``keys`` off ``owner`` (the layer leaves its device, or the patcher)."""
    keys = set(keys)
    for attribute in ("weight_function", "bias_function"):
        functions = owner.__dict__.get(attribute)
        if functions:
            setattr(owner, attribute, [f for f in functions if not (isinstance(f, OnTheFlyPatch) and f.key in keys)])


def patched_weight(patches: Mapping[str, list[Patch]], key: str, owner: torch.nn.Module, name: str) -> torch.Tensor:
    """Weight ``key`` dequantised and patched, in float32 (what ComfyUI asks for to save or extract a model)."""
    layout = layout_of(owner, name)
    return calculate_weight(patches[key], layout.decode(getattr(owner, name), torch.float32), key)
