"""A placing node answered from ComfyUI's cache still says where its models are now.

ComfyUI shows a node's text when the node runs, and again when it comes from the cache only for an output node
(a VRAM Report: the text of the run that made it, however old). A loader or a Move To GPU from the cache showed
nothing ("The node's report appears here when it runs"), in a new tab too: the nodes that decide placement said
nothing about where things are. So each placing node remembers (weakly) the models it gave out, and when ComfyUI
says a prompt takes it from the cache (``execution_cached``), the pack sends the node's text as ComfyUI sends a run's
(``executed``, to the client that queued the prompt): where each of those models is now, read from the pack's books
and ComfyUI's, marked as from the cache (``device_control_cached``, which the node's badge reads).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from .bridge.moves import where_now
from .bridge.subjects import subject_of
from .state import inventory

log = logging.getLogger("device_control")

#: The first line of a cached placing node's text.
CACHED = "From ComfyUI's cache (this node did not run). Where its models are now:"

_given: dict[str, list[weakref.ref]] = {}  # node id -> the models it gave out when it last ran


def node_id_of(node: type | None) -> str | None:
    """The id of the node ComfyUI runs as ``node`` (its hidden ``unique_id``), where it has one."""
    return getattr(getattr(node, "hidden", None), "unique_id", None)


def remember(node: type | None, values: Iterable[Any]) -> None:
    """Node ``node`` (the class ComfyUI runs) gave out ``values``: the models among them (of any kind Move To GPU
    takes) are kept, weakly, for its text when it comes from the cache."""
    node_id = node_id_of(node)
    if node_id is None:
        return
    _given[str(node_id)] = [weakref.ref(value) for value in values if subject_of(value) is not None]


def text_now(node_id: str) -> str | None:
    """The text of node ``node_id`` from the cache: where each model it gave out is now (``None``: it gave out
    none that is still alive, or it is not one of ours)."""
    subjects = [subject_of(value()) for value in _given.get(node_id, ()) if value() is not None]
    if not subjects:
        return None
    snapshot = inventory.snapshot()
    lines = [f"  {subject.name}: {where_now(subject.patcher, snapshot)}" for subject in subjects if subject]
    return "\n".join([CACHED, *lines])


def tell_cached(prompt_id: str, nodes: Iterable[Any], client: str | None, send: Callable[..., None]) -> None:
    """ComfyUI takes ``nodes`` of prompt ``prompt_id`` from its cache: each placing node of ours gets its text now,
    sent with ``send`` (the server's own ``send_sync``) to ``client``."""
    for node in nodes:
        text = text_now(str(node))
        if text is None:
            continue
        output = {"text": [text], "device_control_cached": [True]}
        send(
            "executed", {"node": str(node), "display_node": str(node), "output": output, "prompt_id": prompt_id}, client
        )
