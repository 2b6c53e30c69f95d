"""The tensors of a weight's patches (LoRA factors and the like) kept on the device a streamed weight computes on.

An on-the-fly patch (``core.weights.patching.OnTheFlyPatch``) runs at every forward of its layer. Left in host
memory, its factors would cross to the device each time, a blocking copy per patched layer per step (a device
synchronisation each on CUDA). Instead they cross once, when the patch first computes after a load: packed into one
block of host memory that starts on a page and holds whole pages (so page-locking it touches no page another
locked range lies on), page-locked where the backend and the pinned-memory cap allow, and copied in one
non-blocking copy on the current stream, so the computation that reads them is ordered after it. The device copy
lives as long as the patch function (dropped when its layer stops streaming, when its model unloads, or when its
patches change); the host block is given back after its copy is known to have ended.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
    bytes they take."""

    target: Target
    source: list[Patch]
    patches: list[Patch]
    nbytes: int

    def serves(self, patches: Sequence[Patch], target: Target) -> bool:
        """Whether these are ``patches`` (the same tuples, in order) on ``target``."""
        return (
            same_target(self.target, target)
            and len(patches) == len(self.source)
            and all(a is b for a, b in zip(patches, self.source, strict=True))
        )


def factor_bytes(patches: Sequence[Patch]) -> int:
    """The device bytes :func:`place_patches` takes for ``patches`` (what a plan keeps room for)."""
    return _layout(_host_tensors(patches))[1]


def place_patches(patches: Sequence[Patch], target: Target) -> PlacedPatches:
    """``patches`` with every host tensor they hold copied to ``target`` in one copy (see the module's docstring)."""
    tensors = _host_tensors(patches)
    if not tensors:
        return PlacedPatches(target, list(patches), list(patches), 0)
    offsets, size = _layout(tensors)
    host = page_block(size)
    for key, tensor in tensors.items():
        _part(host, offsets[key], tensor).copy_(tensor)
    backend = backend_of(target)
    locked = pinned_memory().lock(host, target)
    block = backend.copy_to(host[:size], target, non_blocking=locked)
    stream = backend.current_stream(target)
    event = backend.record(stream) if locked and stream is not None else None
    placed = {key: _part(block, offsets[key], tensor) for key, tensor in tensors.items()}
    swap = lambda t: placed.get(id(t), t)  # noqa: E731 - one expression, used once per patch
    result = PlacedPatches(target, list(patches), [(s, _walk(v, swap), m, o, f) for s, v, m, o, f in patches], size)
    weakref.finalize(result, _give_back, host, target, event).atexit = False  # no device calls at shutdown
    return result


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
