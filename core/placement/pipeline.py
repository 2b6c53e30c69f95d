"""A split model in ``pipeline`` mode: each block computes on the device that holds it, and only activations move.

:func:`place_split` moves every layer's tensors to the device of its part (:mod:`core.placement.split`);
:func:`attach_hops` makes the model run there. Before a layer or a block runs, the tensors it is given that are on
another device are copied to its own (the hidden state leaving one run of blocks, and what the model computed
once at its start and hands every block: a Flux model's ``vec`` and ``pe``, a UNet's ``emb`` and ``context``);
the model's output is copied back to its *home*, the device its caller's inputs are on. Weights never move while
the model runs.

A copy between two accelerators goes straight from one to the other where the backend can (torch orders it
after the work that produced the tensor); between two simulated GPUs it goes through the host. Operations that
a host model runs between its blocks on tensors of different parts (a UNet's skip connections, joined to the
hidden state outside any block) are the host application's to route: the node layer does it through ComfyUI's
own patch points.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..devices.backends import backend_of, target_of
from ..devices.tensors import Target, count_copy, move_own, own_tensors, tensor_bytes
from .split import Split


def place_split(split: Split, targets: Mapping[str, Target]) -> None:
    """Move each layer's own tensors to the target of its part (``targets`` by device name, ``"gpu:0"``).

    Raises:
        torch.OutOfMemoryError: a device had no room (the layers moved so far stay where they went).
    """
    for part in split.parts:
        target = targets[str(part.device)]
        for block in part.blocks:
            for layer in block.layers:
                for name, _tensor, _is_param in list(own_tensors(layer.module)):
                    move_own(layer.module, name, target)


def hop(tensor: torch.Tensor, target: Target) -> torch.Tensor:
    """``tensor`` on ``target``: itself when it is there, else a copy (booked as traffic)."""
    backend = backend_of(target)
    if backend.holds(tensor, target):
        return tensor
    count_copy(target_of(tensor), target, tensor_bytes(tensor))
    return backend.copy_to(tensor, target)


def hop_beside(tensor: torch.Tensor, beside: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the device of ``beside``: for a host model's join of tensors from two parts outside any block
    (a UNet's skip connection and its hidden state), through the host application's patch point."""
    return hop(tensor, target_of(beside))


def hopped(value: Any, target: Target) -> Any:
    """``value`` with the tensors in it (directly, or in a list or tuple) on ``target``; dictionaries are left as
    they are (a host application's options travel in them and are changed in place by its blocks)."""
    if isinstance(value, torch.Tensor):
        return hop(value, target)
    if isinstance(value, (list, tuple)) and any(isinstance(item, torch.Tensor) for item in value):
        items = [hopped(item, target) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


@dataclass
class Hops:
    """The hooks that run a split model where its parts are; :meth:`remove` takes them all off."""

    handles: list[torch.utils.hooks.RemovableHandle] = field(default_factory=list)

    def remove(self) -> None:
        """Take every hook off (the model then runs where its inputs are, as any model)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _to(target: Target) -> Callable[..., tuple[tuple, dict]]:
    def before(_module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return hop_inputs(args, kwargs, target)

    return before


def attach_hops(
    root: torch.nn.Module,
    split: Split,
    targets: Mapping[str, Target],
    home: Target | None = None,
    entry: torch.nn.Module | None = None,
) -> Hops:
    """Hooks on ``root`` (the module :func:`~core.placement.split.blocks_of` was given) that move what each block
    and each layer is given to its device; with a ``home``, the output of ``entry`` (the module its caller calls;
    default ``root``) goes there too."""
    hops = Hops()
    for part in split.parts:
        target = targets[str(part.device)]
        before = _to(target)
        for block in part.blocks:
            modules = {id(layer.module): layer.module for layer in block.layers}
            block_module = root.get_submodule(block.name)
            modules.setdefault(id(block_module), block_module)
            for module in modules.values():
                hops.handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
    if home is not None:
        hops.handles.append((entry or root).register_forward_hook(_back(home)))
    return hops


def return_to_caller(module: torch.nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks that send ``module``'s output back to the device of the first tensor its call is given (a text
    encoder's transformer: its caller builds the attention mask beside the embeddings, and joins the two after).
    The first of ``module``'s pre-hooks, so it sees the call before any other hook moves it."""
    origins: list[Target | None] = []

    def remember(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        origins.append(next((target_of(t) for t in call_tensors(args, kwargs)), None))

    def back(_module: torch.nn.Module, _args: tuple, output: Any) -> Any:
        # Last in, first out: a call that raised leaves its origin behind, and the next call still finds its own.
        origin = origins.pop() if origins else None
        return output if origin is None else hopped(output, origin)

    return [
        module.register_forward_pre_hook(remember, with_kwargs=True, prepend=True),
        module.register_forward_hook(back),
    ]


def call_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a call is given directly or in lists and tuples, in order."""
    found: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(item for item in value if isinstance(item, torch.Tensor))
    return found


def _back(home: Target) -> Callable[..., Any]:
    def back_home(_module: torch.nn.Module, _args: tuple, output: Any) -> Any:
        return hopped(output, home)

    return back_home


def hop_inputs(args: tuple, kwargs: dict, target: Target) -> tuple[tuple, dict]:
    """A call's tensors (directly, or in lists and tuples) on ``target``."""
    return hopped(args, target), {key: hopped(value, target) for key, value in kwargs.items()}


def send_home(home: Target) -> Callable[..., Any]:
    """A forward hook that sends a module's output to ``home``."""
    return _back(home)
