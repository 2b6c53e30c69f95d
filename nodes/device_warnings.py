"""Warnings a user must see without reading the server log: a device this machine does not have (a workflow from
another machine), and an Offload To CPU wired after nothing (it may run before the loader and free nothing); and
the refusals of a prompt with a value our nodes cannot take (``nodes.queue_check``).

Each one is the ``device_control.warning`` event, which ``web/panel/device_warnings.js`` shows as a toast naming
the node (a refusal as an error), and a warning is a log line too. They are raised when the prompt is queued (from
a node's ``validate_inputs``), before anything loads, so they also show when every node is answered from ComfyUI's
cache. The node's own report repeats them when it runs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from ..core.errors import DeviceNotFoundError, InvalidDeviceSpecError
from . import surface
from .bridge.fallback import fallback_note
from .state import inventory

log = logging.getLogger("device_control")

#: The websocket event the frontend shows: ``{"node": "<id>" or None, "title": "Move To GPU", "text": "...",
#: "severity": "warn" or "error"}``.
EVENT = "device_control.warning"

_quiet = False


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """No warning said meanwhile (a check that runs a node's ``validate_inputs`` before ComfyUI does)."""
    global _quiet
    before, _quiet = _quiet, True
    try:
        yield
    finally:
        _quiet = before


def warn(title: str, node_id: str | None, text: str) -> None:
    """Log ``text`` about node ``node_id`` (shown as ``title``) and push it to every open frontend."""
    if _quiet:
        return
    where = f"{title} (node {node_id})" if node_id is not None else title
    log.warning("[Device Control] %s: %s", where, text)
    if surface.running_in_comfyui():
        surface.prompt_server().send_sync(EVENT, {"node": node_id, "title": title, "text": text, "severity": "warn"})


def refuse_text(node_id: str, title: str, text: str, client: str | None) -> None:
    """Push the refusal ``text`` of node ``node_id`` (shown as ``title``) to the frontend that queued the prompt
    (``client``; every one when not known)."""
    payload = {"node": node_id, "title": title, "text": text, "severity": "error"}
    surface.prompt_server().send_sync(EVENT, payload, client)


def missing_devices(**devices: str) -> list[str]:
    """For each device input (by name) naming a device this machine lacks, what will happen instead."""
    snapshot = inventory.snapshot() if devices else None
    notes = []
    for name, spec in devices.items():
        try:
            inventory.resolve(spec, snapshot=snapshot)
        except DeviceNotFoundError as exc:
            notes.append(f"{name}: {fallback_note(exc.problem)}")
        except InvalidDeviceSpecError:
            continue  # a typo, refused by the node's own check
    return notes


def warn_missing_devices(title: str, node_id: str | None, **devices: str) -> None:
    """At queue time: warn of every device input of node ``node_id`` that names a device this machine lacks."""
    for note in missing_devices(**devices):
        warn(title, node_id, note)
