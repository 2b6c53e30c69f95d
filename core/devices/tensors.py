"""Moving one module's own tensors between host memory and a compute device, in place.

A parameter keeps its identity when it moves (its data changes, as ``Module.to`` does it), so weights tied
between modules stay tied and references held elsewhere follow; a buffer is replaced. One set of functions
serves real devices and the simulated one: a ``torch.device`` target moves data with ``Tensor.to``; a
:class:`~core.simulated.SimulatedDevice` target counts the tensor in its books and shares the host data.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .simtensor import SimTensor
from .simulated import SimulatedDevice

Target = torch.device | SimulatedDevice
HOST = torch.device("cpu")


def is_on(tensor: torch.Tensor, target: Target) -> bool:
    """Whether ``tensor`` is resident on ``target``."""
    if isinstance(target, SimulatedDevice):
        return isinstance(tensor, SimTensor) and tensor.sim_device is target
    return tensor.device == target and not isinstance(tensor, SimTensor)


def same_target(a: Target | None, b: Target | None) -> bool:
    """Whether two targets are the same device (a simulated one by identity)."""
    if isinstance(a, SimulatedDevice) or isinstance(b, SimulatedDevice):
        return a is b
    return a is not None and b is not None and a == b


def label_of(target: Target) -> str:
    """``cuda:0``, ``cpu``, ``sim:0``: how errors and logs name a target."""
    return target.label if isinstance(target, SimulatedDevice) else str(target)


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
    if name in module._parameters:
        param = module._parameters[name]
        if param is None or is_on(param, target):
            return
        if isinstance(param, SimTensor):  # leaving a simulated device: the books follow the data
            param.data = param.sim_device.release(param)
        if isinstance(target, SimulatedDevice):
            target.place_in_place(param)
        else:
            param.data = param.data.to(target)
        return
    buffer = module._buffers[name]
    if buffer is None or is_on(buffer, target):
        return
    if isinstance(buffer, SimTensor):
        buffer = buffer.sim_device.release(buffer)
    module._buffers[name] = target.place(buffer) if isinstance(target, SimulatedDevice) else buffer.to(target)


def tensor_bytes(tensor: torch.Tensor) -> int:
    """The bytes a tensor's elements take (views count their own elements, as ComfyUI counts them)."""
    return tensor.numel() * tensor.element_size()
