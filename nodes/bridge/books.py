"""ComfyUI's list of loaded models, seen as ``core.loading``'s managed models, and kept true.

ComfyUI keeps one list, ``current_loaded_models`` (most recently loaded first), and frees memory by asking
its entries to unload. There is no second registry: eviction on a simulated device, Offload To CPU and
Move To GPU's "make room" all work on that list through :class:`ComfyEntry`, and remove an entry exactly
when ComfyUI would (the model left the device entirely).

Keep-resident models: the entry of a model whose placement says ``keep_resident`` becomes a
:class:`KeptEntry` (a subclass of ComfyUI's ``LoadedModel`` that adds no state), whose ``model_unload``
declines when ComfyUI wants room for another model. The user's own requests (Offload To CPU) go through
:func:`user_request`, which lets it unload.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ...core.devices.tensors import HOST, Target, label_of, same_target
from ...core.placement.budget import Placement
from ...core.placement.engine import engine_of
from ...core.placement.eviction import Eviction, make_room
from ...core.placement.split_model import split_of
from ...core.units import format_bytes
from .. import surface
from .split_books import drop_ended_parts, is_part
from .subjects import model_label

log = logging.getLogger("device_control")

_USER_REQUEST: contextvars.ContextVar[bool] = contextvars.ContextVar("device_control_user_request", default=False)


@contextlib.contextmanager
def user_request() -> Iterator[None]:
    """Within this block, unloads are the user's own request: keep-resident models unload too."""
    token = _USER_REQUEST.set(True)
    try:
        yield
    finally:
        _USER_REQUEST.reset(token)


_displacements = 0


def note_displacement() -> None:
    """A model left a device (offloaded, evicted, streamed more): moves made before are no longer in force."""
    global _displacements
    _displacements += 1


def displacements() -> int:
    """How many times a model left a device since ComfyUI started (Move To GPU's cache key).

    A placement undone behind our back counts too: ComfyUI loading a clone of a placed model its own way (a
    branch of the graph without Move To GPU) moves the shared weights without telling us, so the trees we
    placed are checked here, and one that is no longer as we left it counts as displaced.
    """
    with _placed_lock:
        undone = [root for root in list(_placed) if holding_of(root) is None]
        for root in undone:
            _placed.discard(root)
    for root in undone:
        engine = engine_of(root)
        if engine is not None:
            engine.release_streaming()  # the ring's slots are not the other loader's to keep
        note_displacement()
    return _displacements


def placement_of(patcher: Any) -> Placement | None:
    """The placement a patcher carries, or ``None`` (ComfyUI decides)."""
    return getattr(patcher, "device_control_placement", None)


_LOADED_FOR = "device_control_loaded_for"
_placed: weakref.WeakSet[Any] = weakref.WeakSet()
_placed_lock = threading.Lock()


@dataclass(frozen=True)
class Holding:
    """A module tree that Device Control's engine holds as it left it: where, and under which placement
    (``None``: ComfyUI chose the device and the budget)."""

    target: Target
    placement: Placement | None


def note_loaded(root: Any, placement: Placement | None) -> None:
    """Our engine has just loaded ``root`` (a model's module tree) for ``placement``."""
    root.__dict__[_LOADED_FOR] = placement
    if placement is not None:
        with _placed_lock:
            _placed.add(root)


def forget_loaded(root: Any) -> None:
    """``root`` left its device: no placement of ours is in force on it."""
    root.__dict__.pop(_LOADED_FOR, None)
    with _placed_lock:
        _placed.discard(root)


def holding_of(root: Any) -> Holding | None:
    """Where and how our engine holds ``root`` now, or ``None`` when it does not (never loaded by us, offloaded,
    or moved since by someone else: then ComfyUI's own books say where it is)."""
    engine = engine_of(root)
    if engine is None or _LOADED_FOR not in root.__dict__ or not engine.holds(engine.target):
        return None
    return Holding(engine.target, root.__dict__[_LOADED_FOR])


def in_force(patcher: Any) -> bool:
    """Whether ``patcher``'s own placement is the one its weights are held under now."""
    holding = holding_of(patcher.model)
    return holding is not None and holding.placement == placement_of(patcher)


def where(entry: Any) -> Target | None:
    """The device an entry's model is on: where our engine holds it, else ComfyUI's load device (our engine's
    last target is not enough: ComfyUI may have loaded the weights its own way since, through a clone)."""
    patcher = getattr(entry, "model", None)
    if patcher is None:
        return None
    holding = holding_of(patcher.model)
    if holding is not None:
        return holding.target
    return getattr(entry, "device", None)


def resident_on(patcher: Any, target: Target) -> int:
    """Bytes of ``patcher``'s model on ``target``: what is there (our engine, or our split), else ComfyUI's
    figure."""
    held = split_of(patcher.model)
    if held is not None:
        return held.resident_bytes(target)
    engine = engine_of(patcher.model)
    if engine is not None and engine.target is not None:
        return engine.resident_bytes(target) if same_target(engine.target, target) else 0
    device = getattr(patcher, "load_device", None)
    return int(patcher.loaded_size()) if same_target(device, target) else 0


class ComfyEntry:
    """One of ComfyUI's ``LoadedModel`` entries as a :class:`core.placement.eviction.Managed` model.

    Args:
        entry: the entry.
        namer: how to name a device for the user (default: the backend's name, ``sim:0``).
    """

    def __init__(self, entry: Any, namer: Callable[[Target], str] = label_of) -> None:
        self.entry = entry
        patcher = entry.model
        placement = placement_of(patcher)
        self.name = model_label(patcher)
        self.keep_resident = bool(placement and placement.keep_resident)
        here = where(entry)
        self.device = namer(here) if here is not None else "an unknown device"

    def resident_on(self, target: Target | None) -> int:
        patcher = self.entry.model
        if patcher is None:
            return 0
        if target is None:  # wherever it is; in host memory it holds no device memory
            held = split_of(patcher.model)
            if held is not None:
                return held.device_bytes()
            here = where(self.entry)
            return 0 if here is None or same_target(here, HOST) else resident_on(patcher, here)
        return resident_on(patcher, target)

    def give_back(self, target: Target | None, nbytes: int | None) -> int:
        patcher = self.entry.model
        before = self.resident_on(target)
        if nbytes is not None and nbytes < before:
            freed = patcher.partially_unload(patcher.offload_device, nbytes)
            if freed >= nbytes:
                return freed
        unload_entries([self.entry])  # make_room decided this model may go
        return before


def entries() -> list[Any]:
    """ComfyUI's loaded-model entries whose models are still alive, most recently used first; a split model's
    entries for its other devices are left out (its own entry counts every device: ``bridge.split_books``)."""
    return [entry for entry in surface.loaded_models() if _counted(getattr(entry, "model", None))]


def _counted(patcher: Any) -> bool:
    return patcher is not None and not is_part(patcher)


def make_room_for(patcher: Any, target: Target, needed: int, *, include_kept: bool = False) -> Eviction:
    """Free ``needed`` bytes on ``target`` from other models (never ``patcher``'s own model or its clones)."""
    others = [ComfyEntry(e) for e in entries() if not patcher.is_clone(e.model)]
    eviction = make_room(others, target, needed, include_kept=include_kept)
    if eviction.evicted:
        log.info("[Device Control] %s on %s", eviction.summary(), getattr(target, "label", target))
    return eviction


def entry_of(patcher: Any) -> Any | None:
    """ComfyUI's entry for ``patcher`` itself, or ``None``."""
    return next((e for e in entries() if e.model is patcher), None)


def clone_entries(patcher: Any) -> list[Any]:
    """ComfyUI's entries whose models share ``patcher``'s weights (the patcher itself and its clones)."""
    return [e for e in entries() if patcher.is_clone(e.model)]


class KeptEntry(surface.loaded_model_class()):
    """A loaded-model entry that stays when ComfyUI wants room, if its model is to be kept resident."""

    def model_unload(self, memory_to_free: int | None = None, unpatch_weights: bool = True) -> bool:
        placement = placement_of(self.model)
        if placement is not None and placement.keep_resident and not _USER_REQUEST.get():
            log.info(
                "[Device Control] %s stays on %s (keep resident); ComfyUI wanted %s for another model",
                model_label(self.model),
                placement.name,
                format_bytes(memory_to_free) if memory_to_free is not None else "all of it",
            )
            return False
        return super().model_unload(memory_to_free, unpatch_weights)


def keep_entries() -> None:
    """Give every entry of a keep-resident model the behaviour that declines ComfyUI's evictions."""
    for entry in entries():
        placement = placement_of(entry.model)
        if placement is not None and placement.keep_resident and not isinstance(entry, KeptEntry):
            entry.__class__ = KeptEntry  # same object, one method more: ComfyUI's list is untouched otherwise


def unload_entries(chosen: list[Any]) -> dict[Target | None, int]:
    """Unload these entries completely, as the user asked (keep-resident too); bytes freed per device."""
    freed: dict[Target | None, int] = {}
    live = surface.loaded_model_list()
    with user_request():
        for entry in chosen:
            patcher = entry.model
            if patcher is None:
                continue
            target = where(entry)
            before = int(patcher.loaded_size())
            entry.model_unload()
            if entry in live:
                live.remove(entry)
            freed[target] = freed.get(target, 0) + before
    drop_ended_parts()
    return freed
