"""Patches (LoRAs and friends) checked when they reach a model Device Control loads, named by their file.

ComfyUI's ``ModelPatcher.add_patches`` takes any patch and finds out only while sampling that it cannot apply
it (or applies NaN and gives a black image). Our patcher refuses such a patch when it is added, so the node
that adds it fails with the reason and the fix. ``add_patches`` is not told which file the patches come
from; ComfyUI's LoRA loaders (and most packs' that follow them) hold it in a variable ``lora_name``, which
:func:`lora_source` looks for in the calling frames: a name for the message, nothing else depends on it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Container, Mapping
from typing import Any

from ...core.weights.patching import check_patch

#: How many calling frames to look through for the file name (ComfyUI's loader is two or three up).
_FRAMES = 8
_NAMES = ("lora_name", "lora_path")


def lora_file() -> str | None:
    """The LoRA file a calling frame names (as the node gave it: a name in ComfyUI's ``loras`` folders, or a
    path), or ``None``."""
    frame = sys._getframe(1)
    for _ in range(_FRAMES):
        if frame is None:
            break
        for name in _NAMES:
            value = frame.f_locals.get(name)
            if isinstance(value, str) and value:
                return value
        frame = frame.f_back
    return None


def describe(file: str | None) -> str:
    """``LoRA 'detail.safetensors'``, or what to say when the file is not known."""
    if file is None:
        return "a LoRA or model patch (the node that added it did not name its file)"
    return f"LoRA {os.path.basename(file)!r}"


def check_added(patches: Mapping[Any, Any], known: Container[str], source: str) -> None:
    """Check patches as ``add_patches`` receives them (keys may be ``(name, offset[, function])`` tuples); those
    for weights the model does not have are skipped, as ComfyUI skips them.

    Raises:
        PatchError: a patch of an unknown type or with NaN or infinite values, named with ``source`` (its
            file, :func:`describe`) and its weight.
    """
    for key, value in patches.items():
        name = key if isinstance(key, str) else key[0]
        if name in known:
            check_patch(name, value, source)


def check_present(patcher: Any) -> None:
    """Check the patches a ComfyUI patcher already carries when Device Control takes it over (a LoRA applied by
    ComfyUI's loader before Move To GPU).

    Raises:
        PatchError: as :func:`check_added`, before the model moves.
    """
    source = "a LoRA or model patch applied before this node"
    for key, patches in getattr(patcher, "patches", {}).items():
        for patch in patches:
            check_patch(key, patch[1], source)
