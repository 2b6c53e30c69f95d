"""How a loading engine left its module tree, in a form cheap to compare: every sampling call loads its model again,
and an engine that finds the tree as it left it keeps its plan instead of planning and moving again.

A tree is as it was left when every tensor is the same object, of the same class (a simulated device's tensors
change class when they move), on the same device, every layer keeps its streaming mark and its number of tensors,
and the pack moved no tensor anywhere since (:func:`~core.devices.tensors.moves_in_place`): whatever moved a weight,
ComfyUI's loader or ours, changes one of these. Reading them is attribute reads in one loop, no call a layer.
"""

from __future__ import annotations

import weakref

import torch

from ..devices.tensors import moves_in_place
from .plan import Layer
from .streaming import STREAMING_MARK


def tree_state(layers: list[Layer]) -> list:
    """What an engine compares to know its tree is as it left it: the pack's count of moves; for each layer its
    streaming mark and the number of its tensors; for each tensor ``(a weak reference to it, its class, its device)``
    (weak: a tensor another loader replaced must be freed, not kept on its device by this look). Attribute
    reads only (torch's own, not a tensor subclass's: a simulated device's tensors answer in C too), so that a look
    at a model of a thousand tensors costs no more Python calls than one."""
    state: list = [moves_in_place()]
    with torch._C.DisableTorchFunctionSubclass():
        for layer in layers:
            module = layer.module
            params, buffers = module._parameters, module._buffers
            state.append((STREAMING_MARK in module.__dict__, len(params), len(buffers)))
            for tensors in (params, buffers):
                for tensor in tensors.values():
                    if tensor is not None:  # a weak reference: the state must not keep a moved-away tensor alive
                        state.append((weakref.ref(tensor), type(tensor), tensor.device))
    return state


def same_state(before: list, now: list) -> bool:
    """Whether two :func:`tree_state` lists are the same: tensors compared by identity, never by value."""
    if len(before) != len(now) or before[0] != now[0]:
        return False
    for old, new in zip(before[1:], now[1:], strict=True):
        layer_entry = type(old[0]) is bool
        if layer_entry != (type(new[0]) is bool):
            return False
        if layer_entry:
            if old != new:
                return False
        elif old[0]() is not new[0]() or old[1] is not new[1] or old[2] != new[2]:
            return False
    return True
