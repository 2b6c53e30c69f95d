"""Device Control: choose where every ComfyUI model lives, and watch VRAM while a workflow runs.

ComfyUI imports this package from ``custom_nodes/`` and calls :func:`comfy_entrypoint`. ComfyUI is only
imported inside that call, so ``core/`` and the tests can import this package without ComfyUI.
"""

from __future__ import annotations

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    """Return the extension that lists our nodes (ComfyUI's V3 node API)."""
    from .nodes.extension import DeviceControlExtension

    return DeviceControlExtension()
