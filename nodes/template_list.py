"""The pack's templates are listed in the order of their numbers, whatever the disk's order.

ComfyUI lists a pack's example workflows (``GET /workflow_templates``) in the order its file search finds them, which
is the directory's own order: sorted by name on Windows and macOS, in hash order on Linux's usual file systems, where
the template browser's default sort (which keeps the server's order) put ``01 Start here`` last. The frontend takes
a template's title from its file name and nothing else, so the names carry the titles and their numbers the order
a newcomer needs them in (``workflows/``); this middleware sorts the pack's own list by name on the way out and
leaves every other pack's list as ComfyUI made it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from . import surface

log = logging.getLogger("device_control")

TEMPLATE_PATHS = frozenset({"/workflow_templates", "/api/workflow_templates"})
WORKFLOWS = Path(__file__).resolve().parent.parent / "workflows"


def ours() -> frozenset[str]:
    """The names of the pack's templates (its ``workflows/*.json``, without the suffix)."""
    return frozenset(path.stem for path in WORKFLOWS.glob("*.json"))


def in_order(listing: dict[str, Any], names: frozenset[str]) -> dict[str, Any]:
    """ComfyUI's listing (pack folder -> template names) with the list holding ``names`` sorted. The pack is found
    by its templates, not by its folder's name, which is the user's choice when they clone it."""
    return {
        folder: sorted(found) if names and isinstance(found, list) and names <= set(found) else found
        for folder, found in listing.items()
    }


@web.middleware
async def sort_templates(request: web.Request, handler: Callable[..., Awaitable[web.StreamResponse]]) -> Any:
    """``GET /workflow_templates`` as ComfyUI answers it, the pack's list sorted by name."""
    response = await handler(request)
    if request.method != "GET" or request.path not in TEMPLATE_PATHS:
        return response
    try:
        if response.status != 200 or not isinstance(response, web.Response) or response.body is None:
            return response
        listing = json.loads(bytes(response.body))
        if isinstance(listing, dict):
            return web.json_response(in_order(listing, ours()))
    except Exception:  # the list as ComfyUI made it is still a list
        log.exception("[Device Control] could not sort the pack's templates; the list is ComfyUI's")
    return response


_installed = False


def install() -> None:
    """Put the sort behind ComfyUI's ``GET /workflow_templates`` (once, before the server starts serving)."""
    global _installed
    if _installed or not surface.running_in_comfyui():
        return
    surface.prompt_server().app.middlewares.append(sort_templates)
    _installed = True
