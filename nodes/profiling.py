"""The memory profile of every run, recorded from ComfyUI's own execution events.

ComfyUI tells its frontend when a prompt starts, which nodes come from the cache, when each node starts and
finishes, and how the prompt ended, through the events it sends over its websocket (``execution_start``,
``execution_cached``, ``progress_state``, ``execution_success``, ``execution_error``,
``execution_interrupted``). The pack reads each of those events as the server sends it: :func:`install` puts a
listener in front of the server's ``send_sync`` on its instance, which hands every event on unchanged, first,
and then tells the recorder (``core.monitor.profile``). So a node's readings are made on the thread that
executes it, at its start and at its end; no ComfyUI function is replaced. ``progress_state`` is sent whether or
not the prompt came with a client id, the others only when it did: without one, a node finished that was never
seen running is counted as cached, and the prompt ends when the next one starts, or when the profile is read
after the queue went idle.

``GET /device_control/profile`` answers the latest prompt's profile, ``?prompt_id=`` a given one (of the last
20), ``?format=markdown`` as a table for a bug report; at the end of each prompt ``device_control.profile`` goes
to the client that queued it and to every open panel. ``DEVICE_CONTROL_PROFILE=off`` records nothing. A node's
peak comes from the device's peak counter, which the readings do not reset unless ``DEVICE_CONTROL_PEAKS=reset``
(``core.devices.peaks``): a node that set no new high has a peak of at least what the readings saw. The recorder
derives what the node itself did from it (its rise above its start, on the device it computed on); each profile
names the workflow its prompt was queued from (the id the frontend sends in ``extra_pnginfo``), so the frontend
shows its badges on that workflow only.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from ..core.devices.backends import label_of
from ..core.devices.inventory import InventorySnapshot
from ..core.devices.peaks import Peak
from ..core.devices.tensors import copied_onto
from ..core.monitor.profile import Recorder
from ..core.monitor.readings import Reading
from . import bridge, surface
from .cached_texts import tell_cached
from .panel import PREFIX, pusher
from .state import inventory

log = logging.getLogger("device_control")

EVENT = "device_control.profile"
PROFILE_ENV = "DEVICE_CONTROL_PROFILE"
_PROMPT_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_ENDINGS = {"execution_success": "success", "execution_error": "error", "execution_interrupted": "interrupted"}


def _read() -> Reading:
    """The devices (one query of every backend) and the models ComfyUI lists, read from their weights."""
    snapshot, peaks = inventory.take_reading()
    used = {
        d.id: d.torch_allocated for d in snapshot.devices if d.id and d.kind != "cpu" and d.torch_allocated is not None
    }
    used["cpu"] = snapshot.host.process_rss
    models, _notes = bridge.loaded_models(snapshot)
    values, bounded = _peak_figures(peaks)
    bounded |= {"cpu"}  # the resident set is read, not counted at its peak: what a node raised it by is a floor
    return Reading(
        used,
        values,
        {model.key: (model.name, dict(model.resident)) for model in models},
        frozenset(model.key for model in models if model.partial),
        _streamed(snapshot),
        bounded,
    )


def _peak_figures(peaks: Mapping[str, Peak]) -> tuple[dict[str, int], frozenset[str]]:
    """Each device's peak in bytes, and the devices whose peak is only a lower bound."""
    return {d: peak.value for d, peak in peaks.items()}, frozenset(d for d, peak in peaks.items() if not peak.exact)


def _streamed(snapshot: InventorySnapshot) -> dict[str, int]:
    """The bytes the pack has copied onto each GPU so far, by device id (its books count by device label)."""
    copied = copied_onto()
    if not copied:
        return {}
    ids = {label_of(inventory.target(d.id, snapshot)): d.id for d in snapshot.devices if d.id and d.kind != "cpu"}
    return {ids[label]: n for label, n in copied.items() if label in ids}


recorder = Recorder(_read)


class _Listener:
    """Turns ComfyUI's events into the recorder's calls (see the module's docstring)."""

    def __init__(self, send: Callable[[str, Any, str | None], None]) -> None:
        self.send = send  # the server's own send_sync: the profile's event is not heard again
        self.nodes: dict[str, str] = {}  # node id -> its last state, in the prompt seen last
        self.prompt: str | None = None
        self.ended: str | None = None  # the prompt ended last: events sent after its end are not a new run
        self.client: str | None = None
        self.graph: Mapping[str, Any] = {}

    def __call__(self, event: str, data: Any, sid: str | None) -> None:
        prompt_id = data.get("prompt_id") if isinstance(data, dict) else None
        if not isinstance(prompt_id, str) or prompt_id == self.ended:
            return  # not about a prompt, or sent after its end (ComfyUI's last "executing")
        if prompt_id != self.prompt:
            self._start(prompt_id, sid)
        if event == "execution_cached":
            self._cached(prompt_id, data.get("nodes") or ())
        elif event == "progress_state":
            self._states(prompt_id, data.get("nodes") or {})
        elif event in _ENDINGS:
            self._end(prompt_id, _ENDINGS[event])

    def _states(self, prompt_id: str, nodes: Mapping[str, Any]) -> None:
        for key, state in nodes.items():
            if isinstance(state, dict):
                self._progress(prompt_id, str(key), state)

    def _cached(self, prompt_id: str, nodes: Any) -> None:
        for node in nodes:
            self.nodes[str(node)] = "finished"  # its progress says finished too: listed once
            recorder.node_cached(prompt_id, str(node), *self._names(str(node)))

    def _start(self, prompt_id: str, sid: str | None) -> None:
        if self.prompt is not None:
            self._end(self.prompt, "ended")  # no end was sent: a prompt queued without a client id
        self.prompt, self.client, self.nodes = prompt_id, sid, {}
        self.graph, workflow = _running(prompt_id)
        recorder.prompt_started(prompt_id, workflow)

    def _progress(self, prompt_id: str, key: str, state: Mapping[str, Any]) -> None:
        """One node's state in a ``progress_state`` event: running, finished after running, or finished at once
        (from the cache, in a prompt whose ``execution_cached`` was not sent)."""
        node, now = str(state.get("display_node_id") or key), state.get("state")
        before = self.nodes.get(node)
        if now == before or now not in ("running", "finished"):
            return
        self.nodes[node] = now
        names = self._names(str(state.get("real_node_id") or key))
        if now == "running":
            recorder.node_started(prompt_id, node, *names)
        elif before == "running":
            recorder.node_finished(prompt_id, node)
        else:
            recorder.node_cached(prompt_id, node, *names)

    def _end(self, prompt_id: str, status: str) -> None:
        recorder.prompt_ended(prompt_id, status)
        profile = recorder.profile(prompt_id)
        if profile is not None and prompt_id == self.prompt:
            self.prompt, self.ended = None, prompt_id
            for client in {*pusher.listeners(), *([self.client] if self.client else [])}:
                self.send(EVENT, profile, client)

    def close_idle(self) -> None:
        """End the prompt seen last if ComfyUI runs none now (it sent no end: queued without a client id)."""
        prompt = self.prompt
        if prompt is not None and not _running(prompt)[0]:
            self._end(prompt, "ended")

    def _names(self, node: str) -> tuple[str, str]:
        """The node's class and title, from the prompt being run."""
        entry = self.graph.get(node)
        if not isinstance(entry, dict):
            return "", node
        class_type = str(entry.get("class_type", ""))
        meta = entry.get("_meta")
        title = meta.get("title") if isinstance(meta, dict) else None
        return class_type, str(title or class_type or node)


def _running(prompt_id: str) -> tuple[Mapping[str, Any], str | None]:
    """The prompt's graph (API format) and the id of the workflow it was queued from (which the frontend sends in
    ``extra_pnginfo``), from ComfyUI's queue while it runs; empty and ``None`` where they cannot be read."""
    try:
        for item in list(surface.prompt_server().prompt_queue.currently_running.values()):
            if len(item) > 2 and item[1] == prompt_id and isinstance(item[2], dict):
                return item[2], _workflow_id(item[3] if len(item) > 3 else None)
    except Exception as exc:  # a queue of another shape costs the names only
        log.debug("[Device Control] could not read the running prompt: %s", exc)
    return {}, None


def _workflow_id(extra: Any) -> str | None:
    """``extra_data.extra_pnginfo.workflow.id``, where the prompt came with it."""
    for key in ("extra_pnginfo", "workflow", "id"):
        extra = extra.get(key) if isinstance(extra, dict) else None
    return str(extra) if isinstance(extra, str | int) and str(extra) else None


def profiling_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether to record profiles, from ``DEVICE_CONTROL_PROFILE`` (``on``, the default, or ``off``)."""
    text = (os.environ if environ is None else environ).get(PROFILE_ENV, "").strip().lower()
    if text in ("off", "0", "false", "no"):
        return False
    if text not in ("", "on", "1", "true", "yes"):
        log.error("[Device Control] %s=%r is neither on nor off; profiles are recorded.", PROFILE_ENV, text)
    return True


_installed: _Listener | None = None
_routed = False


def install() -> None:
    """Listen to the server's events and add the route (once; no profile under ``DEVICE_CONTROL_PROFILE=off``,
    where the route says so). The same listener gives a placing node from the cache its text now
    (``nodes.cached_texts``), profiles or not."""
    global _installed, _routed
    if _routed:
        return
    _routed = True
    server = surface.prompt_server()
    server.routes.get(f"{PREFIX}/profile")(get_profile)
    send = server.send_sync
    listener = _Listener(send) if profiling_from_env() else None
    if listener is None:
        log.info("[Device Control] %s=off: no profiles are recorded.", PROFILE_ENV)

    def send_sync(event: str, data: Any, sid: str | None = None) -> None:
        send(event, data, sid)
        try:
            if event == "execution_cached" and isinstance(data, dict):
                tell_cached(str(data.get("prompt_id")), data.get("nodes") or (), sid, send)
            if listener is not None:
                listener(event, data, sid)
        except Exception as exc:  # the profile must never cost a run
            log.warning("[Device Control] profile: %s while recording %s: %s", type(exc).__name__, event, exc)

    server.send_sync = send_sync
    _installed = listener


def recording() -> bool:
    """Whether profiles are being recorded."""
    return _installed is not None


def _refuse(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _query_error(query: Mapping[str, str], counts: Mapping[str, int]) -> str | None:
    """What is wrong with the route's query string, or ``None``."""
    unknown = sorted(set(query) - {"prompt_id", "format"})
    if unknown or any(count > 1 for count in counts.values()):
        asked = unknown or list(query)
        return f"unknown or repeated query parameters {asked}; ask ?prompt_id=<id>&format=json or markdown."
    if query.get("format", "json") not in ("json", "markdown"):
        return f"format {query['format']!r} is not json or markdown."
    if "prompt_id" in query and not _PROMPT_ID.match(query["prompt_id"]):
        return "prompt_id must be a prompt's id as /prompt answered it (letters, digits, '-', 1 to 128)."
    return None


async def get_profile(request: web.Request) -> web.Response:
    """``GET /device_control/profile`` (``?prompt_id=``, ``?format=json|markdown``)."""
    query = request.rel_url.query
    problem = _query_error(query, {name: len(query.getall(name)) for name in query})
    if problem is not None:
        return _refuse(400, problem)
    if _installed is None:
        return _refuse(404, f"profiles are off ({PROFILE_ENV}=off); start ComfyUI without it to record them.")
    _installed.close_idle()
    prompt_id = query.get("prompt_id")
    profile = recorder.profile(prompt_id)
    if profile is None:
        return _refuse(404, _no_profile(prompt_id, recorder.prompt_ids()))
    if query.get("format") == "markdown":
        return web.Response(text=recorder.markdown(profile["prompt_id"]) or "", content_type="text/markdown")
    return web.json_response(profile)


def _no_profile(prompt_id: str | None, kept: list[str]) -> str:
    """Why there is no profile to answer, as a sentence (the panel shows it while no run is recorded)."""
    if not kept:
        return "No run recorded yet: queue a prompt and its memory profile appears here."
    which = "the last one" if len(kept) == 1 else f"the last {len(kept)}"
    return f"No profile of prompt {prompt_id!r}: profiles are kept for {which} ({', '.join(kept)})."


def so_far() -> str:
    """The run's heaviest node so far, from the memory profile (or why there is none): a VRAM Report's last line."""
    if not recording():
        return f"profile: off ({PROFILE_ENV}=off)"
    latest = recorder.latest()
    return "profile: no prompt recorded yet" if latest is None else latest.summary()
