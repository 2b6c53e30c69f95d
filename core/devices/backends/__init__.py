"""Device backends: one module per kind of device, each implementing :class:`~.base.DeviceBackend`.

``cuda`` (CUDA and ROCm), ``xpu``, ``npu``, ``mlu`` (these four share ``torch_module``), ``mps``, ``directml``,
``cpu`` and ``simulated``. :func:`default_backends` are the probes the inventory asks, in the order their devices
are numbered ``gpu:0``, ``gpu:1``, ...; :func:`backend_of` is the backend that drives one target. Code that
moves tensors or asks about memory goes through :func:`backend_of` and never asks which kind it got. The simulated
GPU (``core.devices.sim``) is reached through here only: the settings that make its devices
(:func:`simulated_devices_from_env`) and :func:`simulated_backends` for them.
"""

from __future__ import annotations

import torch

from ..sim.device import SimulatedDevice
from ..sim.spec import SIMULATE_ENV, simulated_devices_from_env
from .base import (
    HOST,
    DeviceBackend,
    DeviceInfo,
    HiddenDevices,
    Target,
    describe,
    dtypes_from,
    installed,
    this_process,
)
from .cpu import CpuBackend
from .cuda import CudaBackend, cuda_capabilities
from .directml import DirectMLBackend
from .mlu import MluBackend
from .mps import MpsBackend
from .npu import NpuBackend
from .simulated import SimulatedBackend, simulated_backends
from .torch_module import TorchModuleBackend
from .xpu import XpuBackend

__all__ = [
    "HOST",
    "SIMULATE_ENV",
    "CpuBackend",
    "CudaBackend",
    "DeviceBackend",
    "DeviceInfo",
    "DirectMLBackend",
    "HiddenDevices",
    "MluBackend",
    "MpsBackend",
    "NpuBackend",
    "SimulatedBackend",
    "SimulatedDevice",
    "Target",
    "TorchModuleBackend",
    "XpuBackend",
    "backend_of",
    "cuda_capabilities",
    "default_backends",
    "describe",
    "dtypes_from",
    "installed",
    "label_of",
    "same_target",
    "simulated_backends",
    "simulated_devices_from_env",
    "target_of",
    "this_process",
]

#: The backend driving each ``torch.device`` type (one instance each, so streams and pins are kept once).
_BY_TYPE: dict[str, DeviceBackend] = {
    "cuda": CudaBackend(),
    "xpu": XpuBackend(),
    "npu": NpuBackend(),
    "mlu": MluBackend(),
    "mps": MpsBackend(),
    "privateuseone": DirectMLBackend(),
    "cpu": CpuBackend(),
}
#: The backend driving devices torch does not know, by the class of their device object.
_BY_CLASS: dict[type, DeviceBackend] = {SimulatedDevice: SimulatedBackend()}
_ANY_TORCH_DEVICE = DeviceBackend()


def default_backends() -> list[DeviceBackend]:
    """The probes, in the order their devices are numbered ``gpu:0``, ``gpu:1``, ..."""
    return [
        CudaBackend(),
        XpuBackend(),
        NpuBackend(),
        MluBackend(),
        MpsBackend(),
        DirectMLBackend(),
        CpuBackend(),
    ]


def backend_of(target: Target) -> DeviceBackend:
    """The backend that drives ``target``."""
    if isinstance(target, torch.device):
        return _BY_TYPE.get(target.type, _ANY_TORCH_DEVICE)
    return _BY_CLASS[type(target)]


def target_of(tensor: torch.Tensor) -> Target:
    """Where ``tensor`` is: the device object of a backend torch does not know, or its torch device."""
    target = getattr(tensor, "placement_target", None)
    return tensor.device if target is None else target


def same_target(a: Target | None, b: Target | None) -> bool:
    """Whether two targets are the same device (device objects by identity)."""
    if a is b:
        return a is not None
    return isinstance(a, torch.device) and isinstance(b, torch.device) and a == b


def label_of(target: Target) -> str:
    """``cuda:0``, ``cpu``, ``sim:0``: how errors and logs name a target."""
    return backend_of(target).label(target)
