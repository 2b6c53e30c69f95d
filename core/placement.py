"""Put a module's weights on a compute device, leaving the layers chosen to stream in host memory.

One function serves real devices and the simulated one: a ``torch.device`` target moves tensors with
``Tensor.to``; a :class:`~core.simulated.SimulatedDevice` target places them in its books. Weights of
streamed layers stay where they are and are marked as streamed (cast to the device at each use).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .simulated import SimTensor, SimulatedDevice, mark_streamed

Target = torch.device | SimulatedDevice


def is_on(tensor: torch.Tensor, target: Target) -> bool:
    """Whether ``tensor`` is resident on ``target``."""
    if isinstance(target, SimulatedDevice):
        return isinstance(tensor, SimTensor) and tensor.sim_device is target
    return tensor.device == target and not isinstance(tensor, SimTensor)


def move_tensor(tensor: torch.Tensor, target: Target) -> torch.Tensor:
    """A copy of ``tensor`` on ``target`` (a simulated device shares the host storage instead)."""
    if isinstance(target, SimulatedDevice):
        return target.place(tensor)
    return tensor.to(target)


def place_module(
    module: torch.nn.Module,
    target: Target,
    *,
    streamed: Callable[[torch.nn.Module], bool] = lambda _m: False,
) -> int:
    """Move every parameter and buffer of ``module`` to ``target``, except those of streamed submodules.

    Args:
        module: the root of the tree.
        target: a torch device or a simulated device.
        streamed: says which submodules stream (their weights stay on the host, marked as streamed).

    Returns:
        Bytes now resident on ``target`` (those already there included).
    """
    resident = 0
    for sub in module.modules():
        stream = streamed(sub)
        for name, param in list(sub._parameters.items()):
            if param is None:
                continue
            if stream:
                mark_streamed(param)
                continue
            if not is_on(param, target):
                param = torch.nn.Parameter(move_tensor(param.detach(), target), requires_grad=param.requires_grad)
                sub._parameters[name] = param
            resident += param.numel() * param.element_size()
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None and not stream and not is_on(buffer, target):
                sub._buffers[name] = move_tensor(buffer, target)
    return resident
