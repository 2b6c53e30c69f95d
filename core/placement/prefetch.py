"""Prefetch: the next streamed layers' weights are copied to the device while the current layer computes.

Without it, each streamed layer's copy starts when the layer is reached, and the computation waits for it:
a step takes its compute time plus its transfer time. With it, the copies of the layers that come next are
queued on the device's side stream (``core.devices.transfer``) as each layer starts, so they run during its
computation, and a step takes about the longer of the two.

**Which layers come next** is learned, not assumed: the order streamed layers are used in is recorded, pass
by pass (a pass ends when a layer is used again), so the first pass of a model prefetches nothing and every
later one follows the order the model really runs in, whatever its architecture. The last layer of a pass
prefetches nothing, so no copy is left on the device when sampling ends.

**How far ahead** is the room the plan keeps for streaming (``core.placement.plan.STREAM_COPIES`` copies of the
largest streamed layer), less what the layer computing takes there: its copies, twice over when they are cast to
another dtype or patched (the copy and its result). A layer that computes in the dtype it is stored in leaves room
for two of the largest layers ahead, one that casts for one. The next layer is always queued; more are queued
while they fit. A copy whose layer is not used next after all (the order changed) is dropped.

A copy made ahead is used only if it is still a copy of the weight as it is (same tensor, same version);
otherwise the layer copies it again, as it would without prefetch. ``DEVICE_CONTROL_PREFETCH=off`` turns
prefetch off (to measure what it gains, or to rule it out when looking for a fault).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from ..devices.backends import Target, backend_of, same_target
from ..devices.tensors import tensor_bytes
from ..devices.transfer import LOOKAHEAD, QueuedCopy, queue_copy, use_copy
from ..errors import InvalidSizeError

PREFETCH_ENV = "DEVICE_CONTROL_PREFETCH"

_enabled = True


def prefetch_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether to prefetch, from ``DEVICE_CONTROL_PREFETCH`` (``on`` or ``off``; default on).

    Raises:
        InvalidSizeError: the value is neither (the message shows how to write it).
    """
    text = (os.environ if environ is None else environ).get(PREFETCH_ENV, "").strip().lower()
    if text in ("", "on", "1", "true", "yes"):
        return True
    if text in ("off", "0", "false", "no"):
        return False
    raise InvalidSizeError(f"{PREFETCH_ENV}={text!r} is neither on nor off; write {PREFETCH_ENV}=off to turn it off.")


def use_prefetch(enabled: bool) -> None:
    """Prefetch (or not) for models loaded from now on (the settings do this at start)."""
    global _enabled
    _enabled = enabled


@dataclass
class PrefetchStats:
    """How the copies of streamed weights went: queued ahead and used (``ahead``), made when the layer was
    reached (``on_demand``), or made ahead and dropped unused (``dropped``)."""

    ahead: int = 0
    on_demand: int = 0
    dropped: int = 0


@dataclass(eq=False)
class _InFlight:
    module: torch.nn.Module
    copy: QueuedCopy
    ahead: bool


class Lookahead:
    """The prefetch of one model: the order its streamed layers run in, and the copies queued ahead."""

    def __init__(self) -> None:
        self.room = 0
        self.stats = PrefetchStats()
        self._modules: list[torch.nn.Module] = []
        self._successor: dict[int, torch.nn.Module] = {}
        self._seen: set[int] = set()
        self._previous: torch.nn.Module | None = None
        self._in_flight: dict[int, _InFlight] = {}  # id of the source tensor -> its copy

    # -- set up by the engine ---------------------------------------------------------------------

    def attach(self, modules: Iterable[torch.nn.Module], room: int) -> None:
        """Prefetch for ``modules`` (the streamed layers) within ``room`` bytes (the layer computing and the
        copies ahead of it); forget queued copies."""
        self.detach()
        if not _enabled:
            return
        self.room = room
        self._modules = list(modules)
        for module in self._modules:
            module.__dict__[LOOKAHEAD] = self

    def detach(self) -> None:
        """Stop prefetching (the layers are moved); drop what is queued. The learned order is kept."""
        for module in self._modules:
            module.__dict__.pop(LOOKAHEAD, None)
        self._modules = []
        self.drop_all()

    def drop_all(self) -> None:
        """Drop every copy queued ahead (their device memory is freed)."""
        self.stats.dropped += sum(entry.ahead for entry in self._in_flight.values())
        self._in_flight.clear()
        self._previous = None
        self._seen.clear()

    @property
    def in_flight_bytes(self) -> int:
        """Bytes of the copies queued and not used yet."""
        return sum(entry.copy.nbytes for entry in self._in_flight.values())

    # -- called by a streamed layer ---------------------------------------------------------------

    def before_use(self, module: torch.nn.Module, target: Target, dtype: torch.dtype | None = None) -> None:
        """``module`` is about to compute on ``target`` in ``dtype``: queue its own copies (unless queued
        already), then those of the layers that come next, within the room it leaves."""
        self._learn(module)
        self._queue(module, target, ahead=False)
        window = self.room - _in_use(module, target, dtype)
        chain = list(self._ahead_of(module, window))
        self._drop_unexpected({id(module)} | {id(m) for m in chain}, target)
        queued = sum(entry.copy.nbytes for entry in self._in_flight.values() if entry.module is not module)
        for index, following in enumerate(chain):
            queued = self._queue(following, target, ahead=True, queued=queued, limit=None if index == 0 else window)
            if queued is None:
                return

    def _queue(
        self, module: torch.nn.Module, target: Target, *, ahead: bool, queued: int = 0, limit: int | None = None
    ) -> int | None:
        """Queue the copies of ``module``'s weights that are not queued yet; the bytes queued ahead after that,
        or ``None`` when ``limit`` stopped it."""
        for tensor, copy in _streamed(module, target):
            if id(tensor) in self._in_flight:
                continue
            size = tensor_bytes(tensor)
            if limit is not None and queued + size > limit:
                return None
            self._in_flight[id(tensor)] = _InFlight(module, queue_copy(tensor, target, copy=copy), ahead)
            queued += size
        return queued

    def _drop_unexpected(self, expected: set[int], target: Target) -> None:
        """Drop the copies queued for layers not expected now (the order changed) or for another device."""
        for key, entry in list(self._in_flight.items()):
            if id(entry.module) not in expected or not same_target(entry.copy.target, target):
                self.stats.dropped += entry.ahead
                del self._in_flight[key]

    def take(self, tensor: torch.Tensor, target: Target, *, copy: bool) -> torch.Tensor | None:
        """The queued copy of ``tensor`` on ``target``, once the current stream waited for it; ``None`` when
        there is none that still matches the tensor (the caller copies it as usual)."""
        entry = self._in_flight.pop(id(tensor), None)
        if entry is None or not entry.copy.matches(tensor, copy=copy):
            return None
        if entry.ahead:
            self.stats.ahead += 1
        else:
            self.stats.on_demand += 1
        return use_copy(entry.copy, target)

    # -- internals --------------------------------------------------------------------------------

    def _learn(self, module: torch.nn.Module) -> None:
        """Record that ``module`` follows the previous layer; a layer used again starts a new pass."""
        key = id(module)
        if key in self._seen:
            if self._previous is not None:  # the previous layer ended a pass: nothing follows it
                self._successor.pop(id(self._previous), None)
            self._seen = {key}
        else:
            if self._previous is not None:
                self._successor[id(self._previous)] = module
            self._seen.add(key)
        self._previous = module

    def _ahead_of(self, module: torch.nn.Module, window: int) -> Iterator[torch.nn.Module]:
        """The layers expected after ``module``, nearest first, for ``window`` bytes at most (and the next)."""
        size, visited = 0, {id(module)}
        following = self._successor.get(id(module))
        while following is not None and id(following) not in visited:
            yield following
            size += sum(tensor_bytes(tensor) for tensor, _copy in _streamed(following, None))
            if size > window:
                return
            visited.add(id(following))
            following = self._successor.get(id(following))


def _streamed(module: torch.nn.Module, target: Target | None) -> Iterator[tuple[torch.Tensor, bool]]:
    """The weight and bias a cast layer copies for a computation on ``target`` (those not there already), and
    whether each copy must be private (patch functions will change it)."""
    for name, functions in (("weight", "weight_function"), ("bias", "bias_function")):
        tensor = getattr(module, name, None)
        if not isinstance(tensor, torch.Tensor):
            continue
        if target is not None and backend_of(target).holds(tensor, target):
            continue
        yield tensor, bool(getattr(module, functions, None))


def _in_use(module: torch.nn.Module, target: Target, dtype: torch.dtype | None) -> int:
    """Bytes ``module``'s computation takes on ``target`` for its streamed weights: each copy, and the cast or
    patched result made from it where there is one."""
    total = 0
    for tensor, patched in _streamed(module, target):
        cast = dtype is not None and tensor.dtype != dtype and tensor.is_floating_point()
        total += tensor_bytes(tensor) * (2 if cast or patched else 1)
    return total
