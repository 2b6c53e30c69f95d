"""The memory profile of a run: for every node, its wall time, each device's memory before, after and at peak,
and what happened to the models while it ran.

A :class:`Recorder` is told when a prompt starts, when each node starts and finishes (or was taken from the
cache), and when the prompt ends; at each node's start and finish it reads the devices and the resident models
through two callables its host gives it, so this module knows nothing of the host application. Model events are
what changed between the two readings of a node (loaded, moved, offloaded, evicted, streamed:
``core.monitor.readings``). The readings of memory are the books of each
device: the allocator's bytes on a GPU (and its peak since the previous reading, which the host may know only as a
lower bound: ``peak_bounded`` names those devices, shown with a "≥"), the process's resident set on the CPU.

What a node did is its ``rise`` (its peak above the level the device was at when it started) and its ``device``: the
accelerator whose books it changed most, or the CPU where it changed none. The heaviest node is the one whose rise
is the largest, alone: where two share it, or none raised memory, no node is marked (order decides nothing).

Profiles of the last :data:`KEEP` prompts are kept; a profile never grows past :data:`MAX_NODES` nodes nor
:data:`MAX_EVENTS` events per node (what is left out is counted), and every method is quick and takes one lock
only for its own bookkeeping, so the thread that executes prompts never waits on a reader.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..units import format_bytes
from .readings import ModelEvent, Models, Reading, model_events, streamed_events

#: Profiles kept, newest last.
KEEP = 20
#: Nodes recorded per prompt (a loop that runs a node many times counts each run).
MAX_NODES = 2000
#: Model events recorded per node.
MAX_EVENTS = 50


@dataclass
class NodeProfile:
    """One node of a run. ``status`` is ``running``, ``executed``, ``cached`` or ``failed``; ``start`` and ``wall``
    are seconds from the prompt's start; memory figures are bytes by device id; ``peak_bounded`` lists the devices
    whose peak is only a lower bound ("at least"); ``rise`` is the peak above ``before`` on each device, and
    ``device`` the one the node computed on (see the module's docstring; empty before it finished)."""

    node: str
    class_type: str
    title: str
    status: str
    start: float
    wall: float = 0.0
    before: dict[str, int] = field(default_factory=dict)
    after: dict[str, int] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)
    events: list[ModelEvent] = field(default_factory=list)
    events_left_out: int = 0
    peak_bounded: list[str] = field(default_factory=list)
    rise: dict[str, int] = field(default_factory=dict)
    device: str = ""

    def rise_text(self, device: str) -> str:
        """The rise on ``device`` for people: ``+3.20 GiB``, or ``≥ +3.20 GiB`` where the peak is a lower bound."""
        return ("≥ " if device in self.peak_bounded else "") + "+" + format_bytes(self.rise.get(device, 0))

    def peak_text(self, device: str) -> str:
        """The peak on ``device`` for people: ``3.20 GiB``, or ``≥ 3.20 GiB`` where it is a lower bound."""
        return ("≥ " if device in self.peak_bounded else "") + format_bytes(self.peak[device])


@dataclass
class PromptProfile:
    """One prompt's profile. ``status`` is ``running``, ``success``, ``error`` or ``interrupted``."""

    prompt_id: str
    started: float
    workflow: str | None = None  # the id of the workflow the prompt was queued from, where the client sent it
    status: str = "running"
    wall: float = 0.0
    nodes: list[NodeProfile] = field(default_factory=list)
    nodes_left_out: int = 0
    recording: float = 0.0  # seconds the readings themselves took, on the executing thread

    def heaviest(self) -> tuple[NodeProfile, str, int] | None:
        """The node that raised memory most (its rise on the device it computed on), that device and the rise;
        ``None`` where no node raised any, or two raised the same most (a tie is no node's)."""
        rises = sorted(
            ((node.rise.get(node.device, 0), i) for i, node in enumerate(self.nodes) if node.device), reverse=True
        )
        if not rises or rises[0][0] <= 0 or (len(rises) > 1 and rises[1][0] == rises[0][0]):
            return None
        node = self.nodes[rises[0][1]]
        return node, node.device, rises[0][0]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with the heaviest node's id (``null`` when none ran)."""
        data = asdict(self)
        heaviest = self.heaviest()
        data["heaviest"] = None if heaviest is None else {"node": heaviest[0].node, "device": heaviest[1]}
        return data

    def summary(self) -> str:
        """``heaviest node so far: KSampler (3), +3.20 GiB on gpu:0`` (or why no node is)."""
        heaviest = self.heaviest()
        if heaviest is None:
            ran = any(node.device for node in self.nodes)
            why = "no node raised memory more than every other" if ran else "no node has run yet"
            return f"heaviest node so far: none ({why})"
        node, device, _rise = heaviest
        return f"heaviest node so far: {node.title} ({node.node}), {node.rise_text(device)} on {device}"

    def markdown(self) -> str:
        """A markdown table of the nodes, for a bug report."""
        devices = sorted({device for node in self.nodes for device in node.peak})
        head = ["node", "class", "status", "time", "rise", *(f"peak {device}" for device in devices), "model events"]
        lines = [
            f"Prompt {self.prompt_id} ({self.status}, {self.wall:.2f} s)",
            "",
            _row(head),
            _row(["---"] * len(head)),
        ]
        for node in self.nodes:
            peaks = [node.peak_text(device) if device in node.peak else "" for device in devices]
            events = "; ".join(f"{e.kind} {e.model} ({format_bytes(e.bytes)})" for e in node.events)
            rise = f"{node.rise_text(node.device)} on {node.device}" if node.device else ""
            cells = [f"{node.title} ({node.node})", node.class_type, node.status, f"{node.wall:.3f} s", rise]
            lines.append(_row([*cells, *peaks, events]))
        return "\n".join(lines) + "\n"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


class Recorder:
    """Records the profile of each prompt from what its host tells it.

    Args:
        read: reads the host now (at each node's start and finish: the peaks of the second reading are the
            node's).
        clock: seconds, monotonic (for tests).
    """

    def __init__(self, read: Callable[[], Reading], clock: Callable[[], float] = time.perf_counter) -> None:
        self._read, self._clock = read, clock
        self._lock = threading.Lock()
        self._profiles: OrderedDict[str, PromptProfile] = OrderedDict()
        self._origin: dict[str, float] = {}
        self._running: dict[tuple[str, str], tuple[NodeProfile, Models]] = {}

    # -- what the host says -----------------------------------------------------------------------

    def prompt_started(self, prompt_id: str, workflow: str | None = None) -> None:
        """A prompt starts (again: a second call for the same prompt changes nothing); ``workflow`` is the id of
        the workflow it was queued from, where known (the frontend shows a profile's badges on that one only)."""
        with self._lock:
            if prompt_id in self._profiles:
                return
            for other in self._profiles.values():  # one prompt runs at a time: one that never ended did now
                if other.status == "running":
                    self._end(other, "interrupted")
            self._profiles[prompt_id] = PromptProfile(prompt_id, time.time(), workflow)
            self._origin[prompt_id] = self._clock()
            while len(self._profiles) > KEEP:
                old, _profile = self._profiles.popitem(last=False)
                self._origin.pop(old, None)

    def node_started(self, prompt_id: str, node: str, class_type: str, title: str) -> None:
        """``node`` starts executing: the memory before it; its peaks are measured from here."""
        self.prompt_started(prompt_id)
        began = self._clock()
        reading = self._read()
        with self._lock:
            record = NodeProfile(node, class_type, title, "running", self._since(prompt_id), before=dict(reading.used))
            if self._add(prompt_id, record):
                self._running[(prompt_id, node)] = (record, reading)
            self._charge(prompt_id, began)

    def node_finished(self, prompt_id: str, node: str) -> None:
        """``node`` finished: its time, the memory after it and its peak, the model events."""
        with self._lock:
            started = self._running.pop((prompt_id, node), None)
        if started is None:
            return
        record, first = started
        began = self._clock()
        now = self._since(prompt_id)
        reading = self._read()
        with self._lock:
            used = reading.used
            record.status, record.wall, record.after = "executed", now - record.start, dict(used)
            record.peak = {d: max(reading.peaks.get(d, 0), record.before.get(d, 0), n) for d, n in used.items()}
            record.peak_bounded = sorted(reading.bounded & record.peak.keys())
            record.rise = {d: peak - record.before.get(d, peak) for d, peak in record.peak.items()}
            record.device = compute_device(record)
            events = model_events(first.models, reading.models, now, reading.partial)
            events += streamed_events(first, reading, now)
            record.events, record.events_left_out = events[:MAX_EVENTS], max(0, len(events) - MAX_EVENTS)
            self._charge(prompt_id, began)

    def node_cached(self, prompt_id: str, node: str, class_type: str, title: str) -> None:
        """``node``'s output came from the cache: listed, nothing measured."""
        self.prompt_started(prompt_id)
        with self._lock:
            self._add(prompt_id, NodeProfile(node, class_type, title, "cached", self._since(prompt_id)))

    def prompt_ended(self, prompt_id: str, status: str) -> None:
        """The prompt ended with ``status`` (``success``, ``error``, ``interrupted``); a node still running
        failed."""
        with self._lock:
            profile = self._profiles.get(prompt_id)
            if profile is not None and profile.status == "running":
                self._end(profile, status)

    # -- what readers ask -------------------------------------------------------------------------

    def profile(self, prompt_id: str | None = None) -> dict[str, Any] | None:
        """The profile of ``prompt_id`` (the latest prompt's when ``None``) as JSON-ready data, or ``None``."""
        with self._lock:
            if prompt_id is None:
                profile = next(reversed(self._profiles.values()), None)
            else:
                profile = self._profiles.get(prompt_id)
            return None if profile is None else profile.to_dict()

    def markdown(self, prompt_id: str) -> str | None:
        """The profile of ``prompt_id`` as a markdown table, or ``None``."""
        with self._lock:
            profile = self._profiles.get(prompt_id)
            return None if profile is None else profile.markdown()

    def latest(self) -> PromptProfile | None:
        """The latest prompt's profile (a copy, safe to read while the prompt runs)."""
        with self._lock:
            profile = next(reversed(self._profiles.values()), None)
            if profile is None:
                return None
            return replace(profile, nodes=list(profile.nodes))

    def prompt_ids(self) -> list[str]:
        """The ids of the profiles kept, oldest first."""
        with self._lock:
            return list(self._profiles)

    # -- internals (under the lock) ---------------------------------------------------------------

    def _since(self, prompt_id: str) -> float:
        return self._clock() - self._origin.get(prompt_id, self._clock())

    def _charge(self, prompt_id: str, began: float) -> None:
        profile = self._profiles.get(prompt_id)
        if profile is not None:
            profile.recording += self._clock() - began

    def _add(self, prompt_id: str, record: NodeProfile) -> bool:
        profile = self._profiles.get(prompt_id)
        if profile is None:
            return False
        if len(profile.nodes) >= MAX_NODES:
            profile.nodes_left_out += 1
            return False
        profile.nodes.append(record)
        return True

    def _end(self, profile: PromptProfile, status: str) -> None:
        profile.status = status
        profile.wall = self._since(profile.prompt_id)
        for key in [key for key in self._running if key[0] == profile.prompt_id]:
            record, _first = self._running.pop(key)
            record.status, record.wall = "failed", profile.wall - record.start


def compute_device(node: NodeProfile) -> str:
    """The device ``node`` computed on: the accelerator whose books it changed most (its rise, else how much its
    level moved), or ``cpu`` where it changed none."""
    changes = {
        device: max(node.rise.get(device, 0), abs(node.after.get(device, 0) - node.before.get(device, 0)))
        for device in node.peak
        if device != "cpu"
    }
    device, most = max(sorted(changes.items()), key=lambda item: item[1], default=("cpu", 0))
    return device if most > 0 else "cpu"
