"""A whole model that computes on another device than the model that calls it: a ControlNet placed on a second
GPU, called at every step by the sampler of a diffusion model on the first.

The host application hands such a model its caller's tensors (the noisy latent, the timestep, the text context,
the hint image) and adds what it returns to its caller's own, on the caller's device: the two must meet
somewhere. :func:`cross_to_placement` hooks the model so that each call's tensors go to the device the engine
placed it on, and its output (tensors directly, or in lists, tuples and dictionaries: a ControlNet's residuals by
block) comes back to the device of the first tensor the call was given. Only the call's inputs and outputs
cross, once per call; the weights stay where they were placed. While the engine does not hold the model (the
host application loaded it its own way since), a call runs where it is given, as without the hooks: the model's
weights are then wherever that load put them, beside its caller.
"""

from __future__ import annotations

from typing import Any

import torch

from ..devices.backends import target_of
from ..devices.tensors import Target
from .engine import PartialModel, partial_model_of
from .pipeline import call_tensors, hop_inputs, hopped

_CROSSING = "_device_control_crossing"


def _returned(value: Any, origin: Target) -> Any:
    """``value`` with its tensors (directly, in lists and tuples, or in a dictionary's values) on ``origin``."""
    if isinstance(value, dict):
        return {key: _returned(item, origin) for key, item in value.items()}
    return hopped(value, origin)


class _Crossing:
    """The two hooks of one model; where each call came from, last in first out (a call that raised leaves its
    origin behind, and the next call still finds its own)."""

    def __init__(self, engine: PartialModel) -> None:
        self.engine = engine
        self.origins: list[Target | None] = []

    def before(self, _module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        tensors = call_tensors(args, kwargs)
        target = self.engine.target
        if not tensors or target is None or not self.engine.holds(target):
            self.origins.append(None)
            return None
        self.origins.append(target_of(tensors[0]))
        return hop_inputs(args, kwargs, target)

    def after(self, _module: torch.nn.Module, _args: tuple, output: Any) -> Any:
        origin = self.origins.pop() if self.origins else None
        return output if origin is None else _returned(output, origin)


def cross_to_placement(root: torch.nn.Module) -> None:
    """Hook ``root`` so that it computes where the engine placed it whatever device its caller is on (see the
    module's docstring). Once per module: every later placement of it, on any device, is served by the same
    hooks, which read the engine's device at each call."""
    if _CROSSING in root.__dict__:
        return
    crossing = _Crossing(partial_model_of(root))
    root.register_forward_pre_hook(crossing.before, with_kwargs=True, prepend=True)
    root.register_forward_hook(crossing.after)
    root.__dict__[_CROSSING] = crossing
