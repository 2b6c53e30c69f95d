"""Which layers of a model stay resident on its compute device under a budget, and which stream from RAM.

A *layer* is a module with tensors of its own. A layer that speaks the cast protocol (``comfy_cast_weights``,
``weight_function``, ``bias_function``: ComfyUI's layers and ``core.weights.ops``' alike) can stream: its
weights stay in host memory and its forward casts them to the input's device for each use. Any other layer
must be resident.

**The streaming reserve.** While a streamed layer computes, what it copied is on the device in its stored dtype
and, cast or patched, in the compute dtype; the copies queued ahead for the next layers are there too. The
budget keeps room for that: the *streaming reserve*, :data:`STREAM_COPIES` times the largest *piece* that
crosses at once. A piece is a whole streamed layer, or one row slice of a layer streamed in slices
(``core.devices.slices``): a layer larger than the *streaming unit* the budget allows streams in slices of at
most the unit. The unit is ``budget * STREAM_SHARE / STREAM_COPIES`` (at least :data:`MIN_UNIT`), so the
reserve is at most :data:`STREAM_SHARE` of the budget whatever the size of the model's layers, and the rest of
the budget holds resident layers; a budget too tight for what cannot stream plus that reserve is planned with
the smallest unit before it is declared short. Layers no larger than the unit stream whole, without slicing
overhead, and no layer is sliced finer than the largest streamed piece, which sets the reserve anyway
(``core.placement.pieces``). A quantised piece (a GGUF model's, ``core.weights.quantized``) crosses in its
blocks and is decoded on the device into several times their bytes: the reserve keeps room for that decode,
temporaries included, so it is then more than :data:`STREAM_SHARE` of the budget. The reserve holds streamed
weights only: activations are not part of a model's budget (ComfyUI keeps room for them on the devices it manages,
the patcher on the others).

**Policy.** Which streamable layers stay resident when not all fit: ``largest-first`` (as ComfyUI does) keeps the
biggest layers, so the fewest bytes per layer stream and the reserve is smallest; ``execution-order`` keeps the
first layers, so the copies of the later ones could overlap with the computation of the earlier ones.
``tools/bench/run_all.py`` measures both (``--only policy``); the default is :data:`DEFAULT_POLICY`, for the reason
given there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch

from ..devices.slices import RowSlices, row_geometry
from ..devices.tensors import Target, is_on, own_tensors, tensor_bytes
from .pieces import STREAM_COPIES, Multiples, Option, largest, options_of, room_for, stream_reserve, widened

__all__ = ["STREAM_COPIES", "stream_reserve"]  # reckoned in core.placement.pieces, read by the plan's users here

#: The streaming reserve is at most this share of the budget: the streaming unit is the budget times this share
#: over :data:`STREAM_COPIES` (1/36 of the budget: 16.7 MiB of a 600 MiB budget).
STREAM_SHARE = 1 / 12

#: The smallest streaming unit: below a budget of 36 MiB the reserve is more than :data:`STREAM_SHARE` of it,
#: rather than copies so small that their fixed cost dominates.
MIN_UNIT = 1024**2

#: A module with this attribute set stays resident even when it could stream (a host application needs it on
#: the compute device: a text encoder reads its device from its token embedding, for instance).
RESIDENT_MARK = "device_control_resident"


class Policy(str, Enum):
    """Which streamable layers stay resident when a model does not fit its budget."""

    LARGEST_FIRST = "largest-first"
    EXECUTION_ORDER = "execution-order"


#: Largest-first streams the fewest bytes per streamed layer and needs the smallest casting room (see
#: ``tools/bench/run_all.py --only policy`` and docs/bench/policy.md for the measurements behind this choice).
DEFAULT_POLICY = Policy.LARGEST_FIRST


@dataclass(eq=False)
class Layer:
    """One module with tensors of its own: its size, whether it can stream, and the geometry of its rows when it
    can stream in row slices (``rows`` is 0 when it cannot)."""

    name: str
    module: torch.nn.Module
    nbytes: int
    streamable: bool
    rows: int = 0
    row_bytes: int = 0

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
            rows, row_bytes = (row_geometry(module) if streamable else None) or (0, 0)
            layers.append(Layer(name, module, nbytes, streamable, rows, row_bytes))
    return layers


def streaming_unit(budget: int) -> int:
    """The most bytes one streamed piece may take under ``budget`` (see the module's docstring)."""
    return max(MIN_UNIT, int(budget * STREAM_SHARE / STREAM_COPIES))


@dataclass(frozen=True)
class Plan:
    """Which layers are resident under a budget (the rest stream, some in row slices) and the bytes on each side.

    ``reserve_bytes`` is the streaming reserve (:func:`stream_reserve` of the largest streamed piece), ``unit``
    the streaming unit the plan was made with, ``slices`` the row slices of the layers that stream in slices,
    ``patch_bytes`` what the streamed layers keep on the device beside their weights (the factors of their
    on-the-fly patches, ``core.weights.patch_factors``), ``ready_bytes`` the part of the reserve for one streamed
    piece made ready to compute (the rest is for the copies: ``reserve_bytes - ready_bytes``).
    """

    budget: int
    policy: Policy
    resident: frozenset[str]
    resident_bytes: int
    streamed_bytes: int
    reserve_bytes: int
    fixed_bytes: int
    streamed_layers: int
    unit: int = 0
    slices: Mapping[str, RowSlices] = field(default_factory=dict)
    patch_bytes: int = 0
    ready_bytes: int = 0

    @property
    def needed_bytes(self) -> int:
        """The least the model needs on its device with this plan: what it keeps resident, the reserve, and what
        its streamed layers keep there beside their weights (``patch_bytes``: their patches' factors)."""
        return self.resident_bytes + self.reserve_bytes + self.patch_bytes

    @property
    def over_budget(self) -> bool:
        """Even with every layer that can stream streaming, what cannot stream plus the reserve exceeds the
        budget (the plan then keeps only what cannot stream)."""
        return self.needed_bytes > self.budget


def _greedy(order: Sequence[Layer], room: int) -> list[Layer]:
    chosen, used = [], 0
    for layer in order:
        if used + layer.nbytes <= room:
            chosen.append(layer)
            used += layer.nbytes
    return chosen


def _total(layers: Iterable[Layer]) -> int:
    return sum(layer.nbytes for layer in layers)


def plan_layers(
    layers: Sequence[Layer],
    budget: int,
    policy: Policy = DEFAULT_POLICY,
    *,
    allowed: Iterable[str] | None = None,
    multiples: Mapping[str, int | None] | None = None,
    unit: int | None = None,
    extras: Mapping[str, int] | None = None,
) -> Plan:
    """Choose the resident layers for ``budget`` bytes (weights, the streaming reserve, and the extras of the
    layers that stream).

    ``largest-first`` tries each possible size of the largest streamed piece: layers whose piece is larger must
    be resident, the others are filled in from the largest down, and the choice that keeps the most bytes
    resident wins. ``execution-order`` keeps the longest run of layers from the start that fits with the
    reserve the rest needs.

    Args:
        layers: the model's layers (:func:`layers_of`).
        budget: bytes the model may take on its device.
        policy: which streamable layers to prefer.
        allowed: when given, only these layers may be resident (an unload never moves other layers in).
        multiples: by layer name, the multiple of rows its slices must hold (``None``: it streams whole only,
            e.g. its patches need the whole weight); layers not named slice on :data:`ROW_QUANTUM` rows.
        unit: the streaming unit (default :func:`streaming_unit` of the budget, or :data:`MIN_UNIT` when the
            budget's unit leaves no room for what cannot stream: the least reserve, so a plan over its budget
            says what the model needs at least; an unload keeps its model's unit).
        extras: by layer name, the bytes a layer keeps on the device beside its weights while it streams (its
            on-the-fly patches' factors). When not every layer fits, they are kept room for as if every layer
            that may stream did: a bound, never short, at most the extras of the layers that stay resident over.
    """
    extras = extras or {}
    if unit is not None:
        return _plan_with(layers, budget, policy, allowed, multiples, unit, extras)
    plan = _plan_with(layers, budget, policy, allowed, multiples, streaming_unit(budget), extras)
    if not plan.over_budget or plan.unit == MIN_UNIT:
        return plan
    return _plan_with(layers, budget, policy, allowed, multiples, MIN_UNIT, extras)


def _plan_with(
    layers: Sequence[Layer],
    budget: int,
    policy: Policy,
    allowed: Iterable[str] | None,
    multiples: Multiples,
    unit: int,
    extras: Mapping[str, int],
) -> Plan:
    """:func:`plan_layers` with the streaming unit given."""
    fixed = [layer for layer in layers if not layer.streamable]
    streamable = [layer for layer in layers if layer.streamable]
    options = options_of(streamable, unit, multiples)
    candidates, forced = _candidates(streamable, allowed, options)
    room = budget - _total(fixed)
    if not forced and _total(candidates) == _total(streamable) <= room:
        chosen = candidates  # everything fits: nothing streams, no extras
    else:
        room -= sum(extras.get(layer.name, 0) for layer in streamable)
        if policy is Policy.EXECUTION_ORDER:
            chosen = _longest_prefix(candidates, room, forced, options)
        else:
            chosen = _largest_first(candidates, room, forced, options)
    options = widened(options, _others(streamable, chosen), multiples)
    return _plan_of(layers, budget, policy, [*fixed, *chosen], options, unit, extras)


def _others(layers: Sequence[Layer], chosen: Sequence[Layer]) -> list[Layer]:
    """The ``layers`` not in ``chosen``."""
    kept = {id(layer) for layer in chosen}
    return [layer for layer in layers if id(layer) not in kept]


def _candidates(
    streamable: Sequence[Layer], allowed: Iterable[str] | None, options: Mapping[int, Option]
) -> tuple[list[Layer], Option | None]:
    """The streamable layers that may be resident, and the largest piece and readied piece of those that may not
    (they stream; ``None`` when there are none)."""
    if allowed is None:
        return list(streamable), None
    names = set(allowed)
    candidates = [layer for layer in streamable if layer.name in names]
    return candidates, largest([options[id(la)] for la in streamable if la.name not in names])


def _plan_of(
    layers: Sequence[Layer],
    budget: int,
    policy: Policy,
    resident: Sequence[Layer],
    options: Mapping[int, Option],
    unit: int,
    extras: Mapping[str, int],
) -> Plan:
    """The plan that keeps ``resident`` on the device and streams every other layer."""
    kept = {id(layer) for layer in resident}
    streamed = [layer for layer in layers if id(layer) not in kept]
    ways = [(layer.name, options[id(layer)]) for layer in streamed if layer.streamable]
    reserve, ready = room_for([way for _name, way in ways])
    return Plan(
        budget=budget,
        policy=policy,
        resident=frozenset(layer.name for layer in resident),
        resident_bytes=_total(resident),
        streamed_bytes=_total(streamed),
        reserve_bytes=reserve,
        ready_bytes=ready,
        fixed_bytes=_total(layer for layer in layers if not layer.streamable),
        streamed_layers=len(streamed),
        unit=unit,
        slices=_sliced(ways),
        patch_bytes=_extras_of(ways, extras),
    )


def _extras_of(ways: Sequence[tuple[str, Option]], extras: Mapping[str, int]) -> int:
    """What the streamed layers keep on the device beside their weights."""
    return sum(extras.get(name, 0) for name, _way in ways)


def _sliced(ways: Sequence[tuple[str, Option]]) -> dict[str, RowSlices]:
    """The slices of the streamed layers that stream in slices, by name."""
    return {name: way.slices for name, way in ways if way.slices is not None}


def _largest_first(
    candidates: Sequence[Layer], room: int, forced: Option | None, options: Mapping[int, Option]
) -> list[Layer]:
    """The resident layers that keep the most bytes, over every choice of the largest piece that streams."""
    ordered = sorted(candidates, key=lambda layer: -layer.nbytes)
    best, chosen = -1, []
    floor = forced.piece if forced is not None else 0
    for biggest in sorted({options[id(layer)].piece for layer in ordered} | {floor}, reverse=True):
        if biggest < floor:
            break
        option = _keeping_all_above(ordered, biggest, room, options, forced)
        if option is not None and _total(option) > best:
            best, chosen = _total(option), option
    return chosen


def _keeping_all_above(
    ordered: Sequence[Layer], biggest: int, room: int, options: Mapping[int, Option], forced: Option | None
) -> list[Layer] | None:
    """Every layer whose piece is bigger than ``biggest`` (the biggest that may stream), then as many others as
    fit with the reserve for streaming any of them; ``None`` when the bigger ones alone do not fit."""
    must = [layer for layer in ordered if options[id(layer)].piece > biggest]
    may = [layer for layer in ordered if options[id(layer)].piece <= biggest]
    left = room - room_for([forced, *(options[id(layer)] for layer in may)])[0] - _total(must)
    if left < 0:
        return None
    return must + _greedy(may, left)


def _longest_prefix(
    candidates: Sequence[Layer], room: int, forced: Option | None, options: Mapping[int, Option]
) -> list[Layer]:
    """The longest run of layers from the start that fits with the reserve the rest needs."""
    rest = [room_for([forced])[0]] * (len(candidates) + 1)  # rest[i]: the reserve of the layers from i on
    tail = forced  # the largest piece and readied piece of those, with the forced ones
    for i in range(len(candidates) - 1, -1, -1):
        tail = largest([tail, options[id(candidates[i])]])
        rest[i] = room_for([tail])[0]
    used, length = 0, 0
    for i, layer in enumerate(candidates):
        if used + layer.nbytes + rest[i + 1] > room:
            break
        used += layer.nbytes
        length = i + 1
    if rest[length] > room:
        return []
    return list(candidates[:length])
