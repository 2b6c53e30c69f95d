"""Moving one module's own tensors between host memory and a compute device, in place.

A parameter keeps its identity when it moves (its data changes, as ``Module.to`` does it), so weights tied
between modules stay tied and references held elsewhere follow; a buffer is replaced. The backend of the
device a tensor leaves lets go of it first, then the backend of the device it goes to takes it
(``core.devices.backends``); each move is counted in :func:`traffic`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .backends import HOST, Target, backend_of, label_of, same_target, target_of

__all__ = [
    "HOST",
    "Target",
    "is_on",
    "label_of",
    "move_own",
    "moves_in_place",
    "own_tensors",
    "same_target",
    "tensor_bytes",
    "traffic",
]


def is_on(tensor: torch.Tensor, target: Target) -> bool:
    """Whether ``tensor`` is resident on ``target``."""
    return backend_of(target).holds(tensor, target)


def own_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """``(name, tensor, is_parameter)`` for the module's own parameters and buffers (not its children's)."""
    for name, param in module._parameters.items():
        if param is not None:
            yield name, param, True
    for name, buffer in module._buffers.items():
        if buffer is not None:
            yield name, buffer, False


def move_own(module: torch.nn.Module, name: str, target: Target) -> None:
    """Move one of ``module``'s own tensors to ``target`` (a no-op when it is there already).

    Raises:
        torch.OutOfMemoryError: the target has no room (nothing changed).
    """
    backend = backend_of(target)
    if name in module._parameters:
        param = module._parameters[name]
        if param is None or backend.holds(param, target):
            return
        source = target_of(param)
        released = backend_of(source).release(param)
        if released is not param:
            param.data = released
        backend.adopt(param, target)
        _count(source, target, param)
        return
    buffer = module._buffers[name]
    if buffer is None or backend.holds(buffer, target):
        return
    source = target_of(buffer)
    module._buffers[name] = backend.place(backend_of(source).release(buffer), target)
    _count(source, target, buffer)


def tensor_bytes(tensor: torch.Tensor) -> int:
    """The bytes a tensor's elements take (views count their own elements, as ComfyUI counts them)."""
    return tensor.numel() * tensor.element_size()


@dataclass
class Traffic:
    """Bytes the product moved to one device (from host memory or another device), from it to host memory, and
    from it to another device (``to_peer``: a split model's activations and streamed weights), and how many
    copies arrived or left."""

    to_device: int = 0
    to_host: int = 0
    to_peer: int = 0
    copies: int = 0


_traffic: dict[str, Traffic] = {}
_traffic_lock = threading.Lock()


def traffic(target: Target) -> Traffic:
    """What the product has moved to and from ``target`` so far (weights moved in place, and copies for one
    use); read it before and after a step to know the bytes that step moved."""
    with _traffic_lock:
        return _traffic.setdefault(label_of(target), Traffic())


def copied_onto() -> dict[str, int]:
    """The bytes the product has copied onto each device so far, by device label: a running count whose
    difference between two moments is what was streamed in between."""
    with _traffic_lock:
        return {label: books.to_device for label, books in _traffic.items()}


def count_copy(source: Target, target: Target, nbytes: int) -> None:
    """Book one copy of ``nbytes`` from ``source`` to ``target``: on the device it reaches, and for a copy between
    two devices on the one it leaves too (``to_peer``)."""
    Route(source, target).add(nbytes)


class Route:
    """The books the copies from one device to another are counted in, found once: a ring copies
    thousands of groups a step along one route, and finding the books by device label was most of the work of
    booking each."""

    def __init__(self, source: Target, target: Target) -> None:
        from_host, self.to_host = backend_of(source).is_host, backend_of(target).is_host
        with _traffic_lock:
            self.books = _traffic.setdefault(label_of(source if self.to_host else target), Traffic())
            peer = not (self.to_host or from_host)
            self.leaving = _traffic.setdefault(label_of(source), Traffic()) if peer else None

    def add(self, nbytes: int) -> None:
        """Book one copy of ``nbytes`` along this route."""
        with _traffic_lock:
            self.books.copies += 1
            if self.to_host:
                self.books.to_host += nbytes
                return
            self.books.to_device += nbytes
            if self.leaving is not None:
                self.leaving.to_peer += nbytes


def _count(source: Target, target: Target, tensor: torch.Tensor) -> None:
    global _moved
    _moved += 1
    count_copy(source, target, tensor_bytes(tensor))


_moved = 0


def moves_in_place() -> int:
    """How many tensors :func:`move_own` has moved so far, whatever the model: an engine that remembers how it
    left its tree knows nothing of ours moved since when this has not changed."""
    return _moved
