"""The tensors of a weight's patches (LoRA factors and the like) kept on the device a streamed weight computes on.

An on-the-fly patch (``core.weights.patching.OnTheFlyPatch``) runs at every forward of its layer. Left in host
memory, its factors would cross to the device each time, a blocking copy per patched layer per step (a device
synchronisation each on CUDA). Instead they cross once per load: the patches of one load share a
:class:`FactorBank`, and the first of them that computes on a device places the factors of every one of them not
there yet, packed into one block of host memory that starts on a page and holds whole pages (so page-locking it
touches no page another locked range lies on), page-locked where the backend and the pinned-memory cap allow, and
copied in one non-blocking copy on the current stream, so the computation that reads them is ordered after it: one
lock, one copy and one event a load, not one per weight (about 700 on SDXL with a LoRA), and past the pinned cap one
blocking copy a load, not one per layer. A patch without a bank (a model split over devices, whose layers compute on
several) places its own factors so. The device copy lives as long as the patch functions that use it (dropped when
their layers stop streaming, when their model unloads, or when their patches change); the host block is given back
once none uses it and its copy is known to have ended.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..devices.backends import Target, backend_of, same_target, target_of
from ..devices.host_memory import page_block
from ..devices.pinned import pinned_memory
from .patch_math import ADAPTERS, Patch
from .patch_rows import AdapterView

#: Each tensor in the block starts on this many bytes (any dtype can be viewed there).
_ALIGN = 64


@dataclass
class PlacedPatches:
    """A weight's patches with their host tensors copied to ``target``: ``patches`` has the same structure as
    ``source`` (the patch tuples they were made from, kept so a change of the list is seen), ``nbytes`` the device
    bytes they take, ``block`` what keeps the host block they crossed from (shared by the patches placed with
    them) until every one of them is gone."""

    target: Target
    source: list[Patch]
    patches: list[Patch]
    nbytes: int
    block: object = None

    def serves(self, patches: Sequence[Patch], target: Target) -> bool:
        """Whether these are ``patches`` (the same tuples, in order) on ``target``."""
        return (
            same_target(self.target, target)
            and len(patches) == len(self.source)
            and all(a is b for a, b in zip(patches, self.source, strict=True))
        )


class Member(Protocol):
    """What a :class:`FactorBank` asks of an on-the-fly patch: its patches now, and where they were placed."""

    placed: PlacedPatches | None

    def current(self) -> list[Patch]:
        """Its patches as they are now (the patch list it reads is shared: patches added later apply too)."""
        ...


class FactorBank:
    """The on-the-fly patches of one load that compute on one device: the first that computes places the factors
    of all of them that are not placed there yet, in one block (see the module's docstring)."""

    def __init__(self) -> None:
        self._members: weakref.WeakSet[Any] = weakref.WeakSet()  # a patch whose layer left is gone with it

    def join(self, member: Any) -> None:
        """``member`` (an on-the-fly patch: a :class:`Member` with a ``bank``) places its factors through this bank
        from now on."""
        member.bank = self
        self._members.add(member)

    def place(self, asking: Member, target: Target) -> PlacedPatches:
        """``asking``'s patches on ``target``, placed in one block with those of every member not placed there."""
        members = [asking]
        for member in list(self._members):
            placed = member.placed
            if member is not asking and (placed is None or not placed.serves(member.current(), target)):
                members.append(member)
        for member in members:
            member.placed = None  # the old copies go before the new ones are made
        for member, placed in zip(members, place_many([m.current() for m in members], target), strict=True):
            member.placed = placed
        return asking.placed


def factor_bytes(patches: Sequence[Patch]) -> int:
    """The device bytes the factors of ``patches`` take (what a plan keeps room for)."""
    return _layout(_host_tensors(patches))[1]


def place_patches(patches: Sequence[Patch], target: Target) -> PlacedPatches:
    """``patches`` with every host tensor they hold copied to ``target`` in one copy (see the module's docstring)."""
    return place_many([patches], target)[0]


def place_many(requests: Sequence[Sequence[Patch]], target: Target) -> list[PlacedPatches]:
    """Each of ``requests`` (a weight's patches) with every host tensor it holds copied to ``target``, all of them
    in one block: one lock, one copy, one event (see the module's docstring)."""
    tensors: dict[int, torch.Tensor] = {}
    owned = []
    for patches in requests:
        own = _host_tensors(patches)
        owned.append(own)
        tensors.update(own)
    if not tensors:
        return [PlacedPatches(target, list(patches), list(patches), 0) for patches in requests]
    offsets, size = _layout(tensors)
    host = page_block(size)
    for key, tensor in tensors.items():
        _part(host, offsets[key], tensor).copy_(tensor)
    backend = backend_of(target)
    locked = pinned_memory().lock(host, target)
    device_block = backend.copy_to(host[:size], target, non_blocking=locked)
    stream = backend.current_stream(target)
    event = backend.record(stream) if locked and stream is not None else None
    placed = {key: _part(device_block, offsets[key], tensor) for key, tensor in tensors.items()}
    swap = lambda t: placed.get(id(t), t)  # noqa: E731 - one expression, used once per patch
    keeper = _Keeper()
    weakref.finalize(keeper, _give_back, host, target, event).atexit = False  # no device calls at shutdown
    return [
        PlacedPatches(
            target,
            list(patches),
            [(s, _walk(v, swap), m, o, f) for s, v, m, o, f in patches],
            _layout(own)[1],
            keeper,
        )
        for patches, own in zip(requests, owned, strict=True)
    ]


class _Keeper:
    """Kept by every :class:`PlacedPatches` of one block: when the last is gone, the host block is given back."""


def _host_tensors(patches: Sequence[Patch]) -> dict[int, torch.Tensor]:
    """The tensors in host memory that ``patches`` hold, each once, by ``id``."""
    tensors: dict[int, torch.Tensor] = {}
    for patch in patches:
        _walk(patch[1], lambda t: tensors.setdefault(id(t), t) if backend_of(target_of(t)).is_host else t)
    return tensors


def _layout(tensors: dict[int, torch.Tensor]) -> tuple[dict[int, int], int]:
    """Where each tensor starts in a block holding them all, and the block's bytes."""
    offsets, size = {}, 0
    for key, tensor in tensors.items():
        offsets[key] = size
        size += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    return offsets, size


def _part(block: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The bytes of ``block`` at ``offset`` seen as a contiguous tensor of ``like``'s dtype and shape."""
    nbytes = like.numel() * like.element_size()
    return block[offset : offset + nbytes].view(like.dtype).view(like.shape)


def _walk(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` (a patch's value: an adapter, tuples and lists of tensors) with ``fn`` applied to each tensor."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        items = [_walk(item, fn) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if getattr(value, "name", None) in ADAPTERS and hasattr(value, "weights"):
        return AdapterView(value.name, _walk(tuple(value.weights), fn))
    return value


def _give_back(host: torch.Tensor, target: Target, event: Any) -> None:
    """Unlock and free the host block once its copy has ended (a copy in flight must never read freed memory)."""
    if event is not None:
        backend_of(target).wait_host(event)
    pinned_memory().unlock(host)
