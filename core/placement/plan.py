"""Which layers of a model stay resident on its compute device under a budget, and which stream from RAM.

A *layer* is a module with tensors of its own. A layer that speaks the cast protocol (``comfy_cast_weights``,
``weight_function``, ``bias_function``: ComfyUI's layers and ``core.weights.ops``' alike) can stream: its
weights stay in host memory and its forward casts them to the input's device for each use. Any other layer
must be resident.

**Policy.** Which streamable layers stay resident when not all fit: ``largest-first`` (as ComfyUI does) keeps
the biggest layers, so the fewest bytes per layer stream and the room kept for casting the streamed ones is
smallest; ``execution-order`` keeps the first layers, so the copies of the later ones could overlap with the
computation of the earlier ones. ``tools/bench.py`` measures both (``--only policy``); the default is
:data:`DEFAULT_POLICY`, for the reason given there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from ..devices.tensors import HOST, Target, is_on, own_tensors, tensor_bytes

#: While a streamed layer computes, its weights are on the device once in their stored dtype and once in the
#: compute dtype (twice the bytes when fp16 computes in fp32): room for that many copies of the largest
#: streamed layer is kept inside the budget.
STREAM_COPIES = 3


#: A module with this attribute set stays resident even when it could stream (a host application needs it on
#: the compute device: a text encoder reads its device from its token embedding, for instance).
RESIDENT_MARK = "device_control_resident"


class Policy(str, Enum):
    """Which streamable layers stay resident when a model does not fit its budget."""

    LARGEST_FIRST = "largest-first"
    EXECUTION_ORDER = "execution-order"


#: Largest-first streams the fewest bytes per streamed layer and needs the smallest casting room (see
#: ``tools/bench.py --only policy`` and README for the measurements behind this choice).
DEFAULT_POLICY = Policy.LARGEST_FIRST


@dataclass(eq=False)
class Layer:
    """One module with tensors of its own: its size, and whether it can stream."""

    name: str
    module: torch.nn.Module
    nbytes: int
    streamable: bool

    def is_resident(self, target: Target | None) -> bool:
        """Whether all of this layer's tensors are on ``target``.

        Read from the tensors each time (a panel asks every second, so this loop stays plain).
        """
        if target is None:
            return False
        module = self.module
        for tensors in (module._parameters, module._buffers):
            for tensor in tensors.values():
                if tensor is not None and not is_on(tensor, target):
                    return False
        return True


def layers_of(root: torch.nn.Module) -> list[Layer]:
    """Every layer of ``root`` in registration order (for the models we drive, the order they run in).

    A layer marked with :data:`RESIDENT_MARK` does not stream. A tensor shared by two modules (tied weights)
    counts once, in the first. Buffers that are not saved with
    the model (non-persistent) count, as they take device memory too (ComfyUI's model sizes leave them out).
    """
    seen: set[int] = set()
    layers: list[Layer] = []
    for name, module in root.named_modules():
        nbytes = 0
        owns = False
        for _tensor_name, tensor, _is_param in own_tensors(module):
            owns = True
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            nbytes += tensor_bytes(tensor)
        if owns:
            streamable = hasattr(module, "comfy_cast_weights") and not getattr(module, RESIDENT_MARK, False)
            layers.append(Layer(name, module, nbytes, streamable))
    return layers


@dataclass(frozen=True)
class Plan:
    """Which layers are resident under a budget (the rest stream) and the bytes on each side."""

    budget: int
    policy: Policy
    resident: frozenset[str]
    resident_bytes: int
    streamed_bytes: int
    reserve_bytes: int
    fixed_bytes: int
    streamed_layers: int

    @property
    def over_budget(self) -> bool:
        """The layers that cannot stream (and the casting room) alone need more than the budget."""
        return self.resident_bytes + self.reserve_bytes > self.budget


def _greedy(order: Sequence[Layer], room: int) -> list[Layer]:
    chosen, used = [], 0
    for layer in order:
        if used + layer.nbytes <= room:
            chosen.append(layer)
            used += layer.nbytes
    return chosen


def _longest_prefix(candidates: Sequence[Layer], room: int, forced: int) -> list[Layer]:
    """The longest run of layers from the start that fits with the casting room the rest needs."""
    rest_max = [0] * (len(candidates) + 1)  # rest_max[i]: the largest layer from i on
    for i in range(len(candidates) - 1, -1, -1):
        rest_max[i] = max(rest_max[i + 1], candidates[i].nbytes)
    used, length = 0, 0
    for i, layer in enumerate(candidates):
        if used + layer.nbytes + STREAM_COPIES * max(rest_max[i + 1], forced) > room:
            break
        used += layer.nbytes
        length = i + 1
    if STREAM_COPIES * max(rest_max[length], forced) > room:
        return []
    return list(candidates[:length])


def _total(layers: Iterable[Layer]) -> int:
    return sum(layer.nbytes for layer in layers)


def plan_layers(
    layers: Sequence[Layer],
    budget: int,
    policy: Policy = DEFAULT_POLICY,
    *,
    allowed: Iterable[str] | None = None,
) -> Plan:
    """Choose the resident layers for ``budget`` bytes (weights plus casting room).

    The casting room is :data:`STREAM_COPIES` times the largest layer that streams. ``largest-first`` tries
    each possible largest streamed size: layers above it must be resident, the others are filled in from
    the largest down, and the choice that keeps the most bytes resident wins. ``execution-order`` keeps the
    longest run of layers from the start that fits with the room the rest needs to stream.

    Args:
        layers: the model's layers (:func:`layers_of`).
        budget: bytes the model may take on its device.
        policy: which streamable layers to prefer.
        allowed: when given, only these layers may be resident (an unload never moves other layers in).
    """
    fixed = [layer for layer in layers if not layer.streamable]
    streamable = [layer for layer in layers if layer.streamable]
    candidates, forced = _candidates(streamable, allowed)
    room = budget - _total(fixed)
    if not forced and _total(candidates) == _total(streamable) <= room:
        chosen = candidates  # everything fits
    elif policy is Policy.EXECUTION_ORDER:
        chosen = _longest_prefix(candidates, room, forced)
    else:
        chosen = _largest_first(candidates, room, forced)
    return _plan_of(layers, budget, policy, resident=[*fixed, *chosen])


def _candidates(streamable: Sequence[Layer], allowed: Iterable[str] | None) -> tuple[list[Layer], int]:
    """The streamable layers that may be resident, and the largest one that may not (it must stream)."""
    if allowed is None:
        return list(streamable), 0
    names = set(allowed)
    candidates = [layer for layer in streamable if layer.name in names]
    return candidates, max((layer.nbytes for layer in streamable if layer.name not in names), default=0)


def _plan_of(layers: Sequence[Layer], budget: int, policy: Policy, *, resident: Sequence[Layer]) -> Plan:
    """The plan that keeps ``resident`` on the device and streams every other layer."""
    kept = {id(layer) for layer in resident}
    streamed = [layer for layer in layers if id(layer) not in kept]
    return Plan(
        budget=budget,
        policy=policy,
        resident=frozenset(layer.name for layer in resident),
        resident_bytes=_total(resident),
        streamed_bytes=_total(streamed),
        reserve_bytes=STREAM_COPIES * max((layer.nbytes for layer in streamed), default=0),
        fixed_bytes=_total(layer for layer in layers if not layer.streamable),
        streamed_layers=len(streamed),
    )


def _largest_first(candidates: Sequence[Layer], room: int, forced: int) -> list[Layer]:
    """The resident layers that keep the most bytes, over every choice of the largest layer that streams."""
    ordered = sorted(candidates, key=lambda layer: -layer.nbytes)
    best, chosen = -1, []
    for largest in sorted({layer.nbytes for layer in ordered} | {forced}, reverse=True):
        if largest < forced:
            break
        option = _keeping_all_above(ordered, largest, room)
        if option is not None and _total(option) > best:
            best, chosen = _total(option), option
    return chosen


def _keeping_all_above(ordered: Sequence[Layer], largest: int, room: int) -> list[Layer] | None:
    """Every layer bigger than ``largest`` (the biggest that may stream), then as many smaller ones as fit with
    the casting room for ``largest``; ``None`` when the bigger ones alone do not fit."""
    must = [layer for layer in ordered if layer.nbytes > largest]
    left = room - STREAM_COPIES * largest - _total(must)
    if left < 0:
        return None
    return must + _greedy([layer for layer in ordered if layer.nbytes <= largest], left)


def is_streaming(layer: Layer) -> bool:
    """Whether ``layer`` is marked to cast its weights on each use (ComfyUI's own mark of a streaming layer)."""
    return hasattr(layer.module, "prev_comfy_cast_weights")


def on_host(layer: Layer) -> bool:
    """Whether all of ``layer``'s tensors are in host memory."""
    return layer.is_resident(HOST)
