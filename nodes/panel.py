"""The live panel's server side: a snapshot route, a push of it while a panel listens, and the panel's actions.

Routes (all under ``/device_control/``; reads are GET, actions are POST with a JSON body, nothing takes a
path or a URL):

* ``GET snapshot``: every device, RAM, every loaded model (with its placement), ComfyUI's memory mode, the
  queue and the node executing now; the same record the push sends;
* ``POST subscribe`` ``{"interval": 1, "client": "<id>"}``: a panel is open and wants a push every
  ``interval`` seconds as the ``device_control.vram`` event (``0``: it closed), sent to that websocket client
  only, at its own rate. Subscriptions are leases, one per client, that the panel renews; when none is alive
  the push thread sleeps;
* ``POST offload`` ``{"model": "<key>"}`` or ``{"all": true}``: move models back to RAM, as Offload To CPU does;
* ``POST free_caches`` ``{}``: give memory the allocators keep cached back to the devices.

Actions wait for no prompt: they are refused (409) while one runs, and while they run no prompt can start, so
a model is never moved under a running sampler; prompts queued meanwhile wait their turn, and the server keeps
serving (see :func:`_while_idle`).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from ..core.devices.pinned import pinned_memory
from ..core.monitor.push import Pusher, check_interval
from . import surface
from .bridge import books
from .bridge.reading import model_key, target_id
from .memory_report import make_report
from .state import inventory

log = logging.getLogger("device_control")

EVENT = "device_control.vram"
PREFIX = "/device_control"
MAX_CLIENT_ID = 64
MAX_BODY = 4096


class ActionRefusedError(Exception):
    """An action that cannot run now; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _queue_state() -> tuple[list[Any], list[Any]]:
    queue = surface.prompt_server().prompt_queue
    return queue.get_current_queue_volatile()


def _launch_flags() -> list[str]:
    """The options ComfyUI was started with, names only (values can be private paths)."""
    return [arg.split("=", 1)[0] for arg in sys.argv[1:] if arg.startswith("-")]


def snapshot() -> dict[str, Any]:
    """Everything the panel shows, now (JSON-ready)."""
    running, pending = _queue_state()
    executing = None
    if running:
        executing = {"prompt_id": running[0][1], "node": getattr(surface.prompt_server(), "last_node_id", None)}
    report = make_report(label="panel")
    return {
        "time": time.time(),
        "report": report.to_dict(),
        "pinned": {
            "comfyui": report.mode.pinned_bytes if report.mode is not None else None,
            "device_control": pinned_memory().pinned_bytes,
            "cap": pinned_memory().max_bytes,
        },
        "executing": executing,
        "queue": {"running": len(running), "pending": len(pending)},
        "flags": _launch_flags(),
        "push": pusher.stats(),
    }


def _send(data: dict[str, Any], client: str) -> None:
    surface.prompt_server().send_sync(EVENT, data, client)  # to that client's websocket only


pusher = Pusher(snapshot, _send)


def announce() -> None:
    """Show open panels the placement a node just made, now rather than at the next tick, which could come after
    a later node has undone it (a move, a short sampler, an offload can all fall between two ticks)."""
    pusher.push_now()


_actions = asyncio.Lock()


async def _while_idle(action: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``action`` unless a prompt is running; while it runs, no prompt starts, and the server keeps serving.

    ComfyUI's queue lock is re-entrant (an ``RLock``). The server's own thread (this coroutine's) takes it and
    holds it until the action is done: the prompt worker, another thread, cannot take a prompt meanwhile,
    while handlers on the server's thread (``POST /prompt``, ``GET /queue``) re-enter the lock and run as
    usual, so a prompt queued now waits its turn instead of stalling the server. The action itself runs in a
    helper thread; actions run one at a time.
    """
    queue = surface.prompt_server().prompt_queue
    async with _actions:
        queue.mutex.acquire()  # held by the worker only for instants (taking a prompt, marking it done)
        try:
            if queue.currently_running:
                raise ActionRefusedError(
                    409,
                    "a prompt is running; models are not moved under it. Wait for it to finish (or cancel it) and "
                    "try again, or put an Offload To CPU node in the workflow.",
                )
            return await asyncio.to_thread(action)
        finally:
            queue.mutex.release()


def _offload(key: str | None, everything: bool) -> dict[str, Any]:
    entries = books.entries()
    chosen = entries if everything else [e for e in entries if model_key(e.model) == key]
    if not chosen and not everything:
        raise ActionRefusedError(
            404, f"no loaded model has the key {key!r}; the snapshot lists the models loaded now and their keys."
        )
    devices = inventory.snapshot()
    freed = books.unload_entries(chosen)
    named = {target_id(target, devices): n for target, n in freed.items()}
    surface.soft_empty_cache()
    log.info("[Device Control] panel: offloaded %d model(s): %s", len(chosen), named)
    return {"offloaded": len(chosen), "freed": named}


def _free_caches() -> dict[str, Any]:
    gc.collect()
    surface.soft_empty_cache()
    inventory.empty_caches()
    return {"freed_caches": True}


async def _body(request: web.Request) -> dict[str, Any]:
    """The JSON object a request carries; refused if it is larger than any action needs."""
    raw = await request.content.read(MAX_BODY + 1)
    if len(raw) > MAX_BODY:
        raise ActionRefusedError(
            413, f"the body is larger than {MAX_BODY} bytes; the actions take a small JSON object."
        )
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ActionRefusedError(400, f"the body is not JSON ({exc}); send a JSON object.") from exc
    if not isinstance(body, dict):
        raise ActionRefusedError(400, "the body must be a JSON object.")
    return body


def _error(refused: ActionRefusedError) -> web.Response:
    return web.json_response({"error": str(refused)}, status=refused.status)


async def get_snapshot(_request: web.Request) -> web.Response:
    """``GET /device_control/snapshot``.

    Made on the server's loop: it only reads figures (about 2 ms with three models loaded), and a hop to a
    worker thread would cost more than that while a sampler holds the interpreter. The ``Server-Timing``
    header says how long the snapshot took to make.
    """
    started = time.perf_counter()
    try:
        response = web.json_response(snapshot())
        response.headers["Server-Timing"] = f"snapshot;dur={(time.perf_counter() - started) * 1000:.3f}"
        return response
    except Exception as exc:  # a failing backend query must not turn into an HTML error page
        log.warning("[Device Control] panel snapshot failed: %s: %s", type(exc).__name__, exc)
        return web.json_response({"error": f"the snapshot failed ({type(exc).__name__}: {exc})"}, status=500)


async def post_subscribe(request: web.Request) -> web.Response:
    """``POST /device_control/subscribe`` ``{"interval": seconds, "client": id}``."""
    try:
        body = await _body(request)
        interval, client = _interval(body.get("interval", 1.0)), body.get("client", "")
        if not isinstance(client, str) or not client or len(client) > MAX_CLIENT_ID:
            raise ActionRefusedError(
                400,
                f"client must be your websocket's client id (the clientId of /ws), a string of 1 to {MAX_CLIENT_ID} "
                "characters: updates go to that client only.",
            )
        pusher.subscribe(interval, client)
    except ActionRefusedError as refused:
        return _error(refused)
    return web.json_response({"interval": pusher.interval, "listening": pusher.listening(), "event": EVENT})


def _interval(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ActionRefusedError(400, f"interval {value!r} must be a number of seconds (0 turns the updates off).")
    try:
        check_interval(float(value))
    except ValueError as exc:
        raise ActionRefusedError(400, str(exc)) from exc
    return float(value)


async def post_offload(request: web.Request) -> web.Response:
    """``POST /device_control/offload`` ``{"model": key}`` or ``{"all": true}``."""
    try:
        body = await _body(request)
        key, everything = body.get("model"), body.get("all") is True
        if not everything and not isinstance(key, str):
            raise ActionRefusedError(400, 'send {"model": "<key from the snapshot>"} or {"all": true}.')
        return web.json_response(await _while_idle(lambda: _offload(key, everything)))
    except ActionRefusedError as refused:
        return _error(refused)


async def post_free_caches(request: web.Request) -> web.Response:
    """``POST /device_control/free_caches`` ``{}``."""
    try:
        await _body(request)
        return web.json_response(await _while_idle(_free_caches))
    except ActionRefusedError as refused:
        return _error(refused)


_registered = False


def register_routes() -> None:
    """Add the routes to ComfyUI's server (once; before it starts serving)."""
    global _registered
    if _registered:
        return
    routes = surface.prompt_server().routes
    routes.get(f"{PREFIX}/snapshot")(get_snapshot)
    routes.post(f"{PREFIX}/subscribe")(post_subscribe)
    routes.post(f"{PREFIX}/offload")(post_offload)
    routes.post(f"{PREFIX}/free_caches")(post_free_caches)
    _registered = True
