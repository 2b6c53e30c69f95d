"""Device Control: choose where every ComfyUI model lives, and watch VRAM while a workflow runs.

ComfyUI imports this package from ``custom_nodes/`` and calls :func:`comfy_entrypoint`. At import, only
ComfyUI's V3 node API is looked up (through ``nodes/surface.py``, like every ComfyUI symbol); the nodes and
the rest of ComfyUI are imported inside that call. ``core/`` never imports ComfyUI.

On a ComfyUI older than the oldest version we test (``pyproject.toml``): without the V3 node API, or with one that
lacks what the pack needs, the pack logs one line saying what is missing and which version it needs, and
registers nothing: no node, no web extension, no traceback among the other packs' messages.
"""

from __future__ import annotations

import logging

from .nodes import surface

#: The oldest ComfyUI the tests run on (``requires-comfyui`` in ``pyproject.toml`` says the same).
MINIMUM_COMFYUI = "0.3.75"

if surface.NODE_API_MISSING is None:
    WEB_DIRECTORY = "./web"
elif surface.running_in_comfyui():  # not when a tool or a test runner imports the package
    NODE_CLASS_MAPPINGS: dict[str, type] = {}  # loads nothing; an old ComfyUI accepts an empty mapping
    logging.getLogger("device_control").error(
        "[Device Control] this ComfyUI is too old: %s. Device Control needs "
        "ComfyUI %s or newer and loads nothing here: update ComfyUI to use it.",
        surface.NODE_API_MISSING,
        MINIMUM_COMFYUI,
    )


async def comfy_entrypoint():
    """Return the extension that lists our nodes (ComfyUI's V3 node API)."""
    from .nodes.extension import DeviceControlExtension

    return DeviceControlExtension()
