"""What ComfyUI says over its websocket while it runs a prompt: which nodes it executed, which it answered from its
cache, what each showed, and the warnings Device Control pushed (``device_control.warning``) from the moment the
prompt was queued.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tools.bench.stress import run_coroutine
from tools.runtime.server import ComfyError, ComfyServer

WARNING_EVENT = "device_control.warning"


@dataclass
class Watched:
    """A prompt's run as its websocket told it."""

    prompt_id: str = ""
    executed: list[str] = field(default_factory=list)
    cached: list[str] = field(default_factory=list)
    warnings: list[dict[str, Any]] = field(default_factory=list)
    #: What each node showed (its ``executed`` output), by node id.
    outputs: dict[str, Any] = field(default_factory=dict)
    node_errors: dict[str, Any] = field(default_factory=dict)
    error: Any = None
    #: Every message of the prompt, as (type, node or None), for a failing test's message.
    said: list[tuple[str, Any]] = field(default_factory=list)


async def _watch(server: ComfyServer, prompt: dict[str, Any], timeout: float) -> Watched:
    client = uuid.uuid4().hex
    seen = Watched()
    async with aiohttp.ClientSession() as session, session.ws_connect(f"{server.url}/ws?clientId={client}") as ws:
        body = {"prompt": prompt, "client_id": client}
        async with session.post(f"{server.url}/prompt", json=body) as answer:
            queued = await answer.json()
        seen.node_errors = queued.get("node_errors") or {}
        seen.error = queued.get("error")
        seen.prompt_id = queued.get("prompt_id", "")
        if not seen.prompt_id and seen.node_errors:
            await _refusals(ws, seen)
        deadline = time.monotonic() + timeout
        while seen.prompt_id and (left := deadline - time.monotonic()) > 0:
            message = await ws.receive(timeout=left)
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            kind, data = (lambda m: (m["type"], m.get("data") or {}))(json.loads(message.data))
            if kind == WARNING_EVENT:
                seen.warnings.append(data)
            if data.get("prompt_id") != seen.prompt_id:
                continue
            seen.said.append((kind, data.get("node")))
            if kind == "execution_cached":
                seen.cached += data["nodes"]
            elif kind == "executed":
                seen.outputs[str(data["node"])] = data.get("output")
            elif kind == "executing" and data.get("node") is not None:
                seen.executed.append(data["node"])
            elif kind == "execution_error":
                raise ComfyError(f"prompt {seen.prompt_id} failed: {data.get('exception_message')}")
            elif kind in ("execution_success", "execution_interrupted") or (kind == "executing" and not data["node"]):
                break
        else:
            if seen.prompt_id:
                raise ComfyError(f"prompt {seen.prompt_id} did not finish within {timeout:.0f} s")
    return seen


async def _refusals(ws: aiohttp.ClientWebSocketResponse, seen: Watched, timeout: float = 5.0) -> None:
    """The toasts of a refused prompt (the pack's refusals, ``severity`` error), one for each node refused: they
    follow the answer on the websocket; a refusal of ComfyUI's own sends none (waited for ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while len({w["node"] for w in seen.warnings if w.get("severity") == "error"}) < len(seen.node_errors):
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            message = await ws.receive(timeout=left)
        except asyncio.TimeoutError:
            return
        if message.type == aiohttp.WSMsgType.TEXT and json.loads(message.data)["type"] == WARNING_EVENT:
            seen.warnings.append(json.loads(message.data).get("data") or {})


def watch(server: ComfyServer, prompt: dict[str, Any], timeout: float = 600) -> Watched:
    """Queue ``prompt`` on a websocket of its own and follow it to its end (a refused prompt: its node errors)."""
    try:
        return run_coroutine(_watch(server, prompt, timeout))
    except asyncio.TimeoutError as exc:
        raise ComfyError(f"no message from ComfyUI within {timeout:.0f} s") from exc
