"""ComfyUI's Dynamic VRAM (comfy-aimdo), as the pack meets it: which patchers are dynamic, the classic twin the
pack places instead, and the layers ComfyUI builds without weights while it is on.

ComfyUI's modules are reached through ``nodes/surface.py``; the attributes used here are listed there
(``COMFY_ATTRIBUTES``, ``OPTIONAL``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .. import surface


def is_dynamic(patcher: Any) -> bool:
    """Whether a patcher is ComfyUI's Dynamic VRAM one (``ModelPatcherDynamic``); ``False`` where there is none."""
    check = getattr(patcher, "is_dynamic", None)
    return bool(check()) if callable(check) else False


def classic_clone(patcher: Any) -> Any:
    """A classic (non-dynamic) clone of a Dynamic VRAM patcher, sharing weights. Where the patcher offers
    ``get_non_dynamic_delegate`` (ComfyUI 0.2x and later), its classic twin is kept and reused; before, every
    ``clone(disable_dynamic=True)`` rebuilt one from the loader (``cached_patcher_init``), reading the file again."""
    delegate = getattr(patcher, "get_non_dynamic_delegate", None)
    return delegate() if callable(delegate) else patcher.clone(disable_dynamic=True)


def dynamic_vram_enabled() -> bool | None:
    """Whether ComfyUI's Dynamic VRAM is on; ``None`` where this ComfyUI has no such feature."""
    flag = getattr(surface.comfy_memory_management(), "aimdo_enabled", None)
    return None if flag is None else bool(flag)


@contextmanager
def layers_with_weights() -> Iterator[None]:
    """ComfyUI's layers built with their weights while the pack builds a model.

    With Dynamic VRAM on (from ComfyUI 0.33 on every OS with an NVIDIA GPU, in 0.28 on Windows), ComfyUI builds its
    ``Linear`` and ``Embedding`` with no weight at all and makes it in its own state-dict load, which the pack's
    loaders replace by their own fill (they place with a classic patcher, outside Dynamic VRAM): without this, 184
    layers of SD1.5's UNet had no weight. The flag is set back at once; nothing else reads it while a node runs on
    the prompt thread.
    """
    module = surface.comfy_memory_management()
    flag = getattr(module, "aimdo_enabled", False)
    if flag:
        module.aimdo_enabled = False
    try:
        yield
    finally:
        if flag:
            module.aimdo_enabled = flag


@contextmanager
def classic_builds() -> Iterator[None]:
    """ComfyUI's loaders build the classic way while the pack calls them: their layers with weights
    (:func:`layers_with_weights`) and their patcher ComfyUI's classic ``ModelPatcher``.

    Under Dynamic VRAM ComfyUI's ``main.py`` makes ``comfy.model_patcher.CoreModelPatcher`` its dynamic class, and
    its loaders of a ControlNet, a CLIP vision model or a model patch record no way to rebuild theirs classic, so
    Move To GPU has to refuse what they give (``moves._classic_clone``). The pack's loaders of those kinds build
    them here instead, and place them as any model, without a restart. The name is set back at once; nothing else
    builds a model while a node runs on the prompt thread. A ComfyUI without ``CoreModelPatcher`` (0.3.75) builds
    classic anyway.
    """
    patchers = surface.model_patcher_module()
    core = getattr(patchers, "CoreModelPatcher", None)
    if core is not None:
        patchers.CoreModelPatcher = patchers.ModelPatcher
    try:
        with layers_with_weights():
            yield
    finally:
        if core is not None:
            patchers.CoreModelPatcher = core
