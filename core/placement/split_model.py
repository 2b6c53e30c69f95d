"""A model held split over several devices, as Split Model Across Devices leaves it, and undone again.

:func:`load_split` shares a model's blocks out over the devices of an allocation (:mod:`core.placement.split`) and
puts them there in one of two modes: ``pipeline`` (each part computes where it lives; :mod:`.pipeline` moves the
activations between them) or ``stream`` (the first device computes; :mod:`.donors` streams the others' parts to it
ahead of use). What it leaves is a :class:`SplitModel`, kept on the module tree, that says where every layer
should be, reads where they are (every figure from the tensors, as the engine's), and undoes it all.

Patches (a LoRA) are applied to the stored weights of every layer before it moves, with the owner's exact backup,
so a streamed layer streams its patched weight and the result is the same in both modes and on one device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..devices.memory import is_out_of_memory
from ..devices.tensors import HOST, Target, move_own, own_tensors, same_target
from ..errors import DeviceControlError, first_line
from ..units import format_bytes
from .allocation import Allocation
from .donors import Streamed, place_streamed
from .pipeline import Hops, attach_hops, hop_inputs, place_split, return_to_caller, send_home
from .plan import Layer
from .split import ACTIVATIONS, Split, blocks_of, split_blocks, spread_split
from .streaming import NO_HOOKS, LayerHooks, reset_flags, to_host

#: The two ways a split model runs.
MODES = ("pipeline", "stream")

_HELD = "_device_control_split"


@dataclass
class SplitModel:
    """A module tree split over devices: the split, the device of each part (``targets`` by device name), the
    layers kept beside the caller (``home``), and the hooks and streams that make it run."""

    root: torch.nn.Module
    split: Split
    targets: dict[str, Target]
    mode: str
    home: Target
    home_layers: tuple[Layer, ...] = ()
    key: object = None
    hops: Hops = field(default_factory=Hops)
    streamed: Streamed | None = None

    @property
    def compute(self) -> str:
        """The device that computes in ``stream`` mode (the allocation's first)."""
        return str(self.split.parts[0].device)

    def planned(self) -> list[tuple[Layer, Target]]:
        """Every layer and the device it should be on now."""
        moved_in = {id(layer.module) for layer in (self.streamed.moved_in if self.streamed else ())}
        pairs = [(layer, self.home) for layer in self.home_layers]
        for part in self.split.parts:
            target = self.targets[str(part.device)]
            for block in part.blocks:
                for layer in block.layers:
                    pairs.append((layer, self.targets[self.compute] if id(layer.module) in moved_in else target))
        return pairs

    def resident_bytes(self, target: Target) -> int:
        """Bytes of the model on ``target``, read from the tensors."""
        return sum(layer.nbytes for layer, _where in self.planned() if layer.is_resident(target))

    def per_device(self) -> list[tuple[str, int]]:
        """``[("gpu:0", bytes), ...]``: every device of the split and the bytes of the model on it now."""
        return [(name, self.resident_bytes(target)) for name, target in self.targets.items()]

    def device_bytes(self) -> int:
        """Bytes on devices other than the host (what the split takes of device memory)."""
        return sum(self.resident_bytes(t) for t in self.targets.values() if not same_target(t, HOST))

    def holds(self) -> bool:
        """Whether every layer is where the split put it (nobody moved the tree since)."""
        return _HELD in self.root.__dict__ and all(layer.is_resident(where) for layer, where in self.planned())

    def let_go(self) -> None:
        """Take the hooks and streams off, leaving every tensor where it is (someone else moved the tree)."""
        self.hops.remove()
        if self.streamed is not None:
            self.streamed.release()
        if self.root.__dict__.get(_HELD) is self:
            del self.root.__dict__[_HELD]

    def release(self, hooks: LayerHooks = NO_HOOKS) -> int:
        """Take the hooks and streams off and every layer back to host memory, its patched weights restored;
        returns the bytes freed on devices other than the host."""
        freed = self.device_bytes()
        self.let_go()
        for layer, _where in self.planned():
            hooks.before_leaving(layer)
            to_host(layer)
            reset_flags(layer)
        return freed

    def summary(self) -> str:
        """``pipeline over gpu:0, gpu:1`` and one line per device: its blocks and the bytes there now."""
        total = self.split.total_bytes
        lines = [f"{self.mode} over {', '.join(self.targets)}"]
        for part in self.split.parts:
            here = self.resident_bytes(self.targets[str(part.device)])
            lines.append(f"{part.describe(total)}; {format_bytes(here)} resident there")
        return "\n".join(lines)


def split_of(root: torch.nn.Module) -> SplitModel | None:
    """The split that holds ``root`` now, or ``None`` (never split, released, or moved since by someone else)."""
    held = root.__dict__.get(_HELD)
    return held if held is not None and held.holds() else None


@dataclass(frozen=True)
class SplitRequest:
    """What to split: the module whose blocks are shared out, the modules its host calls (``entries``: a diffusion
    model, or each text encoder), the layers to share, the layers to keep beside the caller, the allocation, the
    mode and where the caller's tensors are (``home``). Each entry's output goes home, unless modules are named
    in ``to_caller``: then the output of each of those goes back to the device of the tensors its call was given
    (a text encoder's transformer: its caller builds the embeddings and masks where the embedding layer is, and
    joins them with the output). ``once_per_use``: the host calls the entries once each time it uses the model
    (a text encoder encodes a prompt), not step after step as a sampler does, so in ``stream`` mode the last
    layer of a call queues no copy for a next one (the prefetch does not wrap), which would stay on the device
    until the model runs again. ``keep_free``: bytes the computing device keeps free for the host's computation
    in ``stream`` mode, beyond which the copies ahead may take more than the streaming reserve
    (:func:`core.placement.donors.place_streamed`)."""

    root: torch.nn.Module
    entries: Sequence[torch.nn.Module]
    layers: Sequence[Layer]
    allocation: Allocation
    mode: str
    home: Target
    home_layers: Sequence[Layer] = ()
    key: object = None
    to_caller: Sequence[torch.nn.Module] = ()
    once_per_use: bool = False
    keep_free: int = ACTIVATIONS


def plan_split(request: SplitRequest) -> Split:
    """The split of ``request`` (nothing moves): in ``stream`` mode, with the donors' blocks spread over the model
    (:func:`~core.placement.split.spread_split`), so their copies overlap the whole pass.

    Raises:
        InvalidAllocationError: the allocation cannot hold the model in whole blocks (with the shortfall).
    """
    split = split_blocks(blocks_of(request.root, request.layers), request.allocation)
    return spread_split(split) if request.mode == "stream" else split


def load_split(
    request: SplitRequest, split: Split, targets: Mapping[str, Target], hooks: LayerHooks = NO_HOOKS
) -> SplitModel:
    """Put ``split`` in place for ``request``: patches applied, every part on its device, the hooks attached.

    Raises:
        DeviceControlError: a device ran out of memory (every layer is back in host memory, nothing lost).
    """
    if request.mode not in MODES:
        raise DeviceControlError(f"unknown mode '{request.mode}': choose 'pipeline' or 'stream'.")
    held = SplitModel(
        request.root, split, dict(targets), request.mode, request.home, tuple(request.home_layers), request.key
    )
    try:
        for layer, where in held.planned():  # patched in place where the weights are now, before they move
            hooks.before_resident(layer, where)
        for layer in held.home_layers:
            for name, _tensor, _is_param in list(own_tensors(layer.module)):
                move_own(layer.module, name, request.home)
        _place(held, request)
    except BaseException as exc:
        oom = is_out_of_memory(exc)
        where = next((name for name, t in targets.items() if _short_on(held, t)), "a device") if oom else ""
        held.release(hooks)
        if not oom:
            raise
        raise DeviceControlError(
            f"{where} ran out of memory while its part of the model moved there ({first_line(exc)}); "
            "every layer is back in RAM. Give that device less in the allocation, free memory on it (Offload To "
            "CPU), or use 'auto'."
        ) from exc
    request.root.__dict__[_HELD] = held
    return held


def _place(held: SplitModel, request: SplitRequest) -> None:
    """Move the parts and attach what runs them: the hops of ``pipeline``, the streams of ``stream``; and, first
    on each entry, a guard that lets go of the split when someone else moved the tree since (a clone loaded by
    the host application's own loader), so the model then runs where its weights are; last, what sends each
    entry's output back (home, or to its caller's device)."""
    for entry in request.entries:
        held.hops.handles.append(entry.register_forward_pre_hook(_guard(held), with_kwargs=True))
        if not request.to_caller:
            held.hops.handles.append(entry.register_forward_hook(send_home(held.home)))
    for module in request.to_caller:
        held.hops.handles += return_to_caller(module)
    if held.mode == "pipeline":
        place_split(held.split, held.targets)
        held.hops.handles += attach_hops(held.root, held.split, held.targets).handles
    else:
        held.streamed = place_streamed(
            held.split,
            held.targets,
            held.compute,
            keep_free=request.keep_free,
            root=held.root,
            wraps=not request.once_per_use,
        )


def _guard(held: SplitModel) -> Callable[..., tuple[tuple, dict] | None]:
    """The entry's pre-hook: in ``stream`` mode the call's tensors go to the computing device; a split that no
    longer holds is let go of first (its hooks off, the weights left where they are)."""

    def before(_module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not held.holds():
            held.let_go()
            return None
        return hop_inputs(args, kwargs, held.targets[held.compute]) if held.mode == "stream" else None

    return before


def _short_on(held: SplitModel, target: Target) -> bool:
    """Whether a layer meant for ``target`` is not there (where a move stopped)."""
    return any(same_target(where, target) and not layer.is_resident(where) for layer, where in held.planned())
