"""What happened to the models between two readings of the host: which were loaded (or partly), moved,
offloaded or evicted, and what was streamed onto a GPU without staying there.

A :class:`Reading` is what ``core.monitor.profile``'s recorder reads at each node's start and finish: the bytes in
use on every device and the resident models. Model events are what changed between a node's two readings: a model
that appeared on a GPU was loaded there (``partially loaded`` when part of it stayed off its compute device), one
that left every GPU was offloaded (``evicted`` when another model arrived on that GPU in the same node), one whose
bytes moved between devices was moved; and the bytes copied onto a GPU that did not stay there were streamed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

#: Bytes by device id (``gpu:0``, ``cpu``).
Memory = Mapping[str, int]


#: Resident models by key: ``(name, {device id: bytes})``.
Models = Mapping[str, tuple[str, Mapping[str, int]]]


@dataclass(frozen=True)
class Reading:
    """One reading of the host: the bytes in use on every device, each device's peak since the previous reading
    (the reading starts it again), the resident models, the keys of those partly off their compute device
    (``partial``), the bytes copied onto each device so far (``streamed``: a running count), and the devices whose
    peak is only a lower bound (``bounded``)."""

    used: Memory
    peaks: Memory
    models: Models
    partial: frozenset[str] = frozenset()
    streamed: Memory = field(default_factory=dict)
    bounded: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ModelEvent:
    """Something that happened to one model during a node: ``kind`` is ``loaded``, ``partially loaded``,
    ``moved``, ``offloaded``, ``evicted`` or ``streamed``; ``before`` and ``after`` are its bytes per device (for
    ``streamed``, ``after`` holds the bytes copied onto each device during the node, and ``model`` names the
    models partly resident there)."""

    kind: str
    model: str
    key: str
    bytes: int
    before: dict[str, int]
    after: dict[str, int]
    at: float


def model_events(before: Models, after: Models, at: float, partial: frozenset[str] = frozenset()) -> list[ModelEvent]:
    """What changed between two readings of the resident models (see the module's docstring). A load that left
    part of the model off its compute device (its key in ``partial``) is ``partially loaded``; a model that left
    a GPU while another arrived there is ``evicted`` (ComfyUI made room for the other)."""
    events = [_event(key, before, after, at, key in partial) for key in sorted(set(before) | set(after))]
    return _evictions([event for event in events if event is not None])


def _event(key: str, before: Models, after: Models, at: float, partial: bool) -> ModelEvent | None:
    """One model's change between two readings, or ``None``."""
    name, old = before.get(key, ("", {}))
    name, new = after.get(key, (name, {}))
    old = {device: n for device, n in old.items() if n}
    new = {device: n for device, n in new.items() if n}
    if old == new:
        return None
    kind, size = _change(old, new)
    return ModelEvent("partially loaded" if kind == "loaded" and partial else kind, name, key, size, old, new, at)


def _evictions(events: list[ModelEvent]) -> list[ModelEvent]:
    """``offloaded`` events become ``evicted`` where another model arrived on a GPU the model left."""
    arrived = {d for e in events if e.kind != "offloaded" for d, n in e.after.items() if n > e.before.get(d, 0)}
    return [
        replace(e, kind="evicted") if e.kind == "offloaded" and arrived & set(e.before) - {"cpu"} else e for e in events
    ]


def streamed_events(first: Reading, last: Reading, at: float) -> list[ModelEvent]:
    """The bytes copied onto each GPU between two readings that did not stay there (weights cast on the fly for
    one use, and prefetched): the copies counted, less what the models held there grew by (a move or a load is
    a ``loaded`` or ``moved`` event, not streaming). Named after the models partly resident there."""
    events = []
    for device, total in sorted(last.streamed.items()):
        moved = total - first.streamed.get(device, 0) - _arrived(first.models, last.models, device)
        if device == "cpu" or moved <= 0:
            continue
        names = [name for key, (name, held) in last.models.items() if key in last.partial and held.get(device)]
        model = ", ".join(sorted(names)) or "weights"
        events.append(ModelEvent("streamed", model, "", moved, {}, {device: moved}, at))
    return events


def _arrived(before: Models, after: Models, device: str) -> int:
    """The bytes the models came to hold on ``device`` between two readings."""
    held = {key: models.get(device, 0) for key, (_name, models) in before.items()}
    return sum(max(0, models.get(device, 0) - held.get(key, 0)) for key, (_name, models) in after.items())


def _change(old: dict[str, int], new: dict[str, int]) -> tuple[str, int]:
    """``(kind, bytes)`` of a model's change from ``old`` to ``new`` bytes per device: onto accelerators (or into
    the books at all) is ``loaded``, off them (or out of the books) ``offloaded``, between devices ``moved`` (the
    bytes that arrived somewhere)."""
    before, after = _on_accelerators(old), _on_accelerators(new)
    if before and not after:
        return "offloaded", before
    if after and not before:
        return "loaded", after
    if before:
        return "moved", sum(max(0, n - old.get(device, 0)) for device, n in new.items())
    total_before, total_after = sum(old.values()), sum(new.values())
    return ("loaded", total_after) if total_after > total_before else ("offloaded", total_before)


def _on_accelerators(held: Mapping[str, int]) -> int:
    return sum(n for device, n in held.items() if device != "cpu")
