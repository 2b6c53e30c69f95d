"""Making room from other models, least recently used first.

A model gives back part of itself (streaming more) before it is unloaded, and models kept resident give
nothing unless the user asks. The models come from the host application's own list (inside ComfyUI, its
``current_loaded_models``, seen through :class:`Managed`), so there is one set of books. The same function
serves a move that needs room on one device and a user's "free N GB" wherever the models are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..devices.memory import free_bytes
from ..devices.tensors import Target
from ..units import format_bytes


class Managed(Protocol):
    """A model that can give device memory back (inside ComfyUI, one of its loaded-model entries).

    ``device`` names where it is, for messages. ``target`` ``None`` in the methods means "the device it is on,
    whichever that is"; a model in host memory holds nothing there.
    """

    name: str
    device: str
    keep_resident: bool

    def resident_on(self, target: Target | None) -> int:
        """Bytes it holds on ``target``."""

    def give_back(self, target: Target | None, nbytes: int | None) -> int:
        """Free ``nbytes`` on ``target`` (``None``: everything); return bytes freed."""


@dataclass(frozen=True)
class Given:
    """What one model gave back, and where."""

    name: str
    freed: int
    device: str


@dataclass
class Eviction:
    """What :func:`make_room` did."""

    needed: int
    freed: int = 0
    evicted: list[Given] = field(default_factory=list)
    short: int = 0

    def take(self, model: Managed, target: Target | None, missing: int) -> None:
        """Have ``model`` give back ``missing`` bytes, or all it holds when that is not more."""
        held = model.resident_on(target)
        if held <= 0:
            return
        freed = model.give_back(target, missing if missing < held else None)
        if freed > 0:
            self.freed += freed
            self.evicted.append(Given(model.name, freed, model.device))

    def summary(self) -> str:
        """``made room: 2.00 GiB from SD15 diffusion model`` (empty when nothing was done)."""
        parts = [f"{format_bytes(given.freed)} from {given.name}" for given in self.evicted]
        text = "made room: " + ", ".join(parts) if parts else ""
        if self.short:
            text += ("; " if text else "") + f"{format_bytes(self.short)} could not be freed"
        return text


def make_room(
    models: Sequence[Managed],
    target: Target | None,
    needed: int,
    *,
    free: Callable[[], int] | None = None,
    include_kept: bool = False,
) -> Eviction:
    """Free ``needed`` bytes, least recently used models first.

    Args:
        models: the models that may give memory back, most recently used first (ComfyUI's own order).
        target: the device that needs room; ``None``: free ``needed`` bytes in all, wherever the models are.
        needed: bytes that must be free on ``target`` (or freed in all, for ``None``).
        free: how to read what is free (default: :func:`core.devices.memory.free_bytes` of ``target``; for
            ``None``, what has been freed so far).
        include_kept: models marked keep-resident give memory back too (after all others): only when the
            user asks for it.
    """
    eviction = Eviction(needed)
    if free is None:
        free = (lambda: eviction.freed) if target is None else (lambda: free_bytes(target))
    for model in _in_eviction_order(models, include_kept):
        missing = needed - free()
        if missing <= 0:
            break
        eviction.take(model, target, missing)
    eviction.short = max(0, needed - free())
    return eviction


def _in_eviction_order(models: Sequence[Managed], include_kept: bool) -> Iterator[Managed]:
    """Least recently used first; models kept resident last, and only when they may go."""
    order = list(reversed(models))
    yield from (model for model in order if not model.keep_resident)
    if include_kept:
        yield from (model for model in order if model.keep_resident)
