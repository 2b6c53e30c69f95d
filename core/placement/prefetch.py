"""Prefetch: the next streamed layers' weights are copied to the device while the current layer computes.

Without it, each streamed layer's copy starts when the layer is reached, and the computation waits for it:
a step takes its compute time plus its transfer time. With it, the copies of the layers that come next are
queued on the device's side stream (``core.devices.transfer``) as each layer starts, so they run during its
computation, and a step takes about the longer of the two.

**Which layers come next** is learned, not assumed: the order streamed layers are used in is recorded, pass
by pass (a pass ends when a layer is used again), so the first pass of a model prefetches nothing and every
later one follows the order the model really runs in, whatever its architecture. The first layer of a pass is
learned as what follows the last one, because a sampler runs the model once a step: the copies of the next
step's first layers cross while this step's last layers compute, instead of the link standing idle there and
the next step starting with a wait (at a link about as fast as the computation, that is the difference between
the copies keeping up and not: ``tools/bench_split.py``). What was queued for a pass that does not come is
dropped when the host says sampling ended (:func:`settle`, from the patcher's cleanup) or when the layers move.
A model run once each time it is used (a text encoder, a VAE) does not wrap (:attr:`Lookahead.wraps`): its last
layer queues nothing.

**How far ahead** is the streaming reserve the plan keeps (``core.placement.plan``: ``STREAM_COPIES`` of the
largest streamed piece), less what the piece computing takes there: its copies, twice over when they are cast to
another dtype or patched (the copy and its result). A piece is what crosses for one computation: a layer streamed
whole (weight and bias), or one row slice of a layer streamed in slices (``core.devices.slices``; its bias
crosses with the first slice and stays until the layer is done). A piece that computes in the dtype it is
stored in leaves room for two of the largest pieces ahead, one that casts for one. The next piece is always
queued (the next slice of the same layer, or the next layer's first); more are queued while they fit. A copy
whose layer is not used next after all (the order changed) is dropped.

A copy made ahead is used only if it is still a copy of the weight as it is (same tensor, same version);
otherwise the layer copies it again, as it would without prefetch. ``DEVICE_CONTROL_PREFETCH=off`` turns
prefetch off (to measure what it gains, or to rule it out when looking for a fault).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from ..devices.backends import Target, backend_of, same_target
from ..devices.slices import SLICES
from ..devices.tensors import tensor_bytes
from ..devices.transfer import GROUPED, LOOKAHEAD, QueuedCopy, queue_copy, use_copy
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


def prefetching() -> bool:
    """Whether models loaded from now on prefetch (:func:`use_prefetch`)."""
    return _enabled


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


@dataclass(frozen=True, eq=False)
class _Piece:
    """One copy a streamed layer makes: its weight or bias, whole or one row slice; ``private`` when patch
    functions will change the copy. Its bytes are counted once, when it is made."""

    tensor: torch.Tensor
    rows: tuple[int, int] | None
    private: bool
    nbytes: int = field(init=False)
    key: tuple[int, tuple[int, int] | None] = field(init=False)  # how its copy is found in flight

    def __post_init__(self) -> None:
        rows, whole = self.rows, tensor_bytes(self.tensor)
        nbytes = whole if rows is None else whole // self.tensor.size(0) * (rows[1] - rows[0])
        object.__setattr__(self, "nbytes", nbytes)  # frozen: set once, here
        object.__setattr__(self, "key", (id(self.tensor), rows))


class Lookahead:
    """The prefetch of one model: the order its streamed layers run in, and the copies queued ahead."""

    def __init__(self) -> None:
        self.room = 0
        #: Whether a pass's last layers copy the next pass's first ahead: for a model its host runs step after
        #: step (a sampler's diffusion model). Its owner turns it off for a model run once each time it is used
        #: (a text encoder, a VAE), whose last layer then queues nothing.
        self.wraps = True
        self.stats = PrefetchStats()
        self._modules: list[torch.nn.Module] = []
        self._successor: dict[int, torch.nn.Module] = {}
        self._seen: set[int] = set()
        self._previous: torch.nn.Module | None = None
        self._in_flight: dict[tuple, _InFlight] = {}  # (id of the source tensor, rows) -> its copy
        # Found once and kept while they hold, because every layer looks ahead over the layers within its window
        # (about fifty of them in an SD1.5 UNet) and a step runs hundreds of layers:
        # - the pieces of each layer, by id of the layer; checked again when the layer itself is reached, and
        #   both caches are dropped when they changed (a weight replaced, patched or moved);
        # - what comes after each piece within its window, nearest first, by (id of the layer, piece number,
        #   window); dropped when the learned order changes.
        # A copy queued from a stale entry is not used anyway (``take`` checks it against the weight as it is).
        self._groups: dict[int, tuple[Target, list[list[_Piece]]]] = {}
        self._chains: dict[tuple[int, int, int], _Chain] = {}

    # -- set up by the engine ---------------------------------------------------------------------

    def attach(self, modules: Iterable[torch.nn.Module], room: int) -> None:
        """Prefetch for ``modules`` (the streamed layers) within ``room`` bytes (the piece computing and the
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
        """Drop every copy queued ahead (their device memory is freed) and what was found of the layers."""
        self.settle()
        self._previous = None
        self._seen.clear()
        self._groups.clear()
        self._chains.clear()

    def settle(self) -> int:
        """Sampling ended: drop the copies queued ahead (those of the next pass's first layers, which may never
        come); the learned order and the pieces found are kept for the next run. Bytes dropped."""
        dropped = self.in_flight_bytes
        self.stats.dropped += sum(entry.ahead for entry in self._in_flight.values())
        self._in_flight.clear()
        return dropped

    @property
    def in_flight_bytes(self) -> int:
        """Bytes of the copies queued and not used yet."""
        return sum(entry.copy.nbytes for entry in self._in_flight.values())

    # -- called by a streamed layer ---------------------------------------------------------------

    def before_use(
        self, module: torch.nn.Module, target: Target, dtype: torch.dtype | None = None, piece: int = 0
    ) -> None:
        """``module`` is about to compute on ``target`` in ``dtype``, with its piece number ``piece`` (its row slice,
        when it streams in slices): queue that piece's copies (unless queued already), then the pieces that come
        next, within the room it leaves."""
        if piece == 0:
            self._learn(module)
            groups = self._check(module, target)
        else:
            groups = self._pieces(module, target)
        current = groups[piece]
        for item in current:
            self._queue(module, item, target, ahead=False)
        window = self.room - _in_use(groups, piece, dtype)
        chain = self._chain(module, piece, groups, target, window)
        self._drop_unexpected(chain.layers, target)
        mine = {item.key for item in current}
        queued = sum(entry.copy.nbytes for key, entry in self._in_flight.items() if key not in mine)
        self._queue_ahead(chain.pieces, target, queued, window)

    def _chain(
        self, module: torch.nn.Module, piece: int, groups: list[list[_Piece]], target: Target, window: int
    ) -> _Chain:
        """The pieces expected after ``module``'s piece number ``piece`` within ``window`` (see :meth:`_ahead_of`),
        found once while the order it follows holds: a step runs every layer, and every layer asks this."""
        key = (id(module), piece, window)
        chain = self._chains.get(key)
        if chain is None:
            found = list(self._ahead_of(module, groups[piece + 1 :], target, window))
            layers = {id(module)} | {id(owner) for owner, _group in found}
            chain = self._chains[key] = _Chain(found, layers)
        return chain

    def _queue_ahead(
        self, chain: list[tuple[torch.nn.Module, list[_Piece]]], target: Target, queued: int, window: int
    ) -> None:
        """Queue the pieces of ``chain`` in order: the first always, the others while ``queued`` bytes stay
        within ``window``."""
        in_flight = self._in_flight
        for index, (owner, group) in enumerate(chain):
            for item in group:
                if item.key in in_flight:  # queued at an earlier layer: most of the chain, most of the time
                    continue
                queued = self._queue(owner, item, target, ahead=True, queued=queued, limit=window if index else None)
                if queued is None:
                    return

    def _queue(
        self,
        module: torch.nn.Module,
        item: _Piece,
        target: Target,
        *,
        ahead: bool,
        queued: int = 0,
        limit: int | None = None,
    ) -> int | None:
        """Queue ``item``'s copy unless it is queued; the bytes queued ahead after that, or ``None`` when
        ``limit`` stopped it."""
        if item.key in self._in_flight:
            return queued
        if limit is not None and queued + item.nbytes > limit:
            return None
        copy = queue_copy(item.tensor, target, copy=item.private, rows=item.rows)
        self._in_flight[item.key] = _InFlight(module, copy, ahead)
        return queued + item.nbytes

    def _drop_unexpected(self, expected: set[int], target: Target) -> None:
        """Drop the copies queued for layers not expected now (the order changed) or for another device."""
        for key, entry in list(self._in_flight.items()):
            if id(entry.module) not in expected or not same_target(entry.copy.target, target):
                self.stats.dropped += entry.ahead
                del self._in_flight[key]

    def take(
        self, tensor: torch.Tensor, target: Target, *, copy: bool, rows: tuple[int, int] | None = None
    ) -> torch.Tensor | None:
        """The queued copy of ``tensor`` (its ``rows``) on ``target``, once the current stream waited for it;
        ``None`` when there is none that still matches the tensor (the caller copies it as usual)."""
        entry = self._in_flight.pop((id(tensor), rows), None)
        if entry is None or not entry.copy.matches(tensor, copy=copy, rows=rows):
            return None
        if entry.ahead:
            self.stats.ahead += 1
        else:
            self.stats.on_demand += 1
        return use_copy(entry.copy, target)

    # -- internals --------------------------------------------------------------------------------

    def _learn(self, module: torch.nn.Module) -> None:
        """Record that ``module`` follows the previous layer; a layer used again starts a new pass, and follows
        the last layer of the pass before where the prefetch :attr:`wraps` (nothing does where it does not)."""
        key, previous = id(module), self._previous
        follows = previous is not None and (self.wraps or key not in self._seen)
        if follows and self._successor.get(id(previous)) is not module:
            self._successor[id(previous)] = module  # after a pass's last layer (when it wraps): the next's first
            self._chains.clear()  # the order changed (or is being learned): the chains found are stale
        elif not follows and previous is not None and self._successor.pop(id(previous), None) is not None:
            self._chains.clear()  # the previous layer ended a pass: nothing follows it any more
        if key in self._seen:
            self._seen = {key}
        else:
            self._seen.add(key)
        self._previous = module

    def _ahead_of(
        self, module: torch.nn.Module, rest: list[list[_Piece]], target: Target, window: int
    ) -> Iterator[tuple[torch.nn.Module, list[_Piece]]]:
        """The pieces expected after the current one, nearest first: ``module``'s ``rest``, then the layers
        expected after it; for ``window`` bytes at most (and the next piece)."""
        size, visited = 0, {id(module)}
        owner: torch.nn.Module | None = module
        groups = rest
        while owner is not None:
            for group in groups:
                yield owner, group
                size += sum(item.nbytes for item in group)
                if size > window:
                    return
            visited.add(id(owner))
            owner = self._successor.get(id(owner))
            if owner is None or id(owner) in visited:
                return
            groups = self._pieces(owner, target)

    def _pieces(self, module: torch.nn.Module, target: Target) -> list[list[_Piece]]:
        """:func:`_pieces` of ``module`` on ``target``, as found before (see :meth:`_check`)."""
        known = self._groups.get(id(module))
        if known is None or not same_target(known[0], target):
            known = self._groups[id(module)] = (target, _pieces(module, target))
        return known[1]

    def _check(self, module: torch.nn.Module, target: Target) -> list[list[_Piece]]:
        """:func:`_pieces` of ``module`` on ``target`` as they are now. When they differ from those found before,
        every piece and chain found is dropped: what changed here may have changed elsewhere too."""
        fresh = _pieces(module, target)
        known = self._groups.get(id(module))
        if known is not None and same_target(known[0], target) and _same_pieces(known[1], fresh):
            return known[1]
        if known is not None:
            self._groups.clear()
            self._chains.clear()
        self._groups[id(module)] = (target, fresh)
        return fresh


def settle(root: torch.nn.Module) -> int:
    """Sampling with ``root`` ended: every prefetch over its layers drops what it queued for a next step (see
    :meth:`Lookahead.settle`), and every ring over them waits for its copies and frees its slots
    (``core.placement.ring``). Bytes dropped or freed on devices."""
    lookaheads, rings = {}, {}
    for module in root.modules():
        if (found := module.__dict__.get(LOOKAHEAD)) is not None:
            lookaheads[id(found)] = found
        if (member := module.__dict__.get(GROUPED)) is not None:
            rings[id(member.ring)] = member.ring
    freed = sum(ring.ring_bytes for ring in rings.values())
    for ring in rings.values():
        ring.settle()
    return freed + sum(lookahead.settle() for lookahead in lookaheads.values())


@dataclass(frozen=True, eq=False)
class _Chain:
    """The pieces expected after one piece within its window, nearest first, each with its layer; ``layers``: the
    ids of those layers and of the piece's own (a copy queued for any other layer is not expected)."""

    pieces: list[tuple[torch.nn.Module, list[_Piece]]]
    layers: set[int]


def _pieces(module: torch.nn.Module, target: Target) -> list[list[_Piece]]:
    """The copies a streamed layer's computation on ``target`` makes (those not there already), by the step
    that uses them: one group for a layer streamed whole (weight and bias); for one streamed in row slices, its
    bias with the first slice, then one group per slice."""
    pieces: list[_Piece] = []
    for name, functions in (("bias", "bias_function"), ("weight", "weight_function")):
        tensor = getattr(module, name, None)
        if not isinstance(tensor, torch.Tensor):
            continue
        if backend_of(target).holds(tensor, target):
            continue
        pieces.append(_Piece(tensor, None, bool(getattr(module, functions, None))))
    slices = module.__dict__.get(SLICES)
    if slices is None or not pieces or pieces[-1].tensor is not getattr(module, "weight", None):
        return [pieces]
    weight = pieces.pop()
    groups = [[_Piece(weight.tensor, rows, weight.private)] for rows in slices.ranges()]
    groups[0][:0] = pieces
    return groups


def _same_pieces(known: list[list[_Piece]], fresh: list[list[_Piece]]) -> bool:
    """Whether two findings of a layer's pieces copy the same tensors' same rows, patched alike (the ids compared
    are of live tensors: the pieces found before hold theirs)."""
    return [[(p.key, p.private) for p in group] for group in known] == [
        [(p.key, p.private) for p in group] for group in fresh
    ]


def _in_use(groups: list[list[_Piece]], piece: int, dtype: torch.dtype | None) -> int:
    """Bytes a layer's computation with its piece number ``piece`` takes on its device: each copy it uses (the
    piece's, and the bias a sliced layer keeps), and the cast or patched result made from it where there is
    one."""
    using = groups[piece] if piece == 0 else [*groups[0][:-1], *groups[piece]]
    total = 0
    for item in using:
        cast = dtype is not None and item.tensor.dtype != dtype and item.tensor.is_floating_point()
        total += item.nbytes * (2 if cast or item.private else 1)
    return total
