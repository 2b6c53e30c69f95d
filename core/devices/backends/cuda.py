"""NVIDIA CUDA, and AMD ROCm (HIP builds of torch present ROCm devices as ``cuda``)."""

from __future__ import annotations

from typing import Any

import torch

from ..host_memory import CudaRuntime, nvidia_driver_devices, platform
from .base import HiddenDevices, visibility_setting
from .torch_module import TorchModuleBackend

#: Host registration through the runtime torch loaded (``core.devices.host_memory``).
RUNTIME = CudaRuntime()


def cuda_capabilities(mod: Any, index: int) -> tuple[bool, bool, bool]:
    """(fp16, bf16, fp8) support of a CUDA device (by compute capability) or a ROCm one (by gfx architecture)."""
    props = mod.get_device_properties(index)
    if torch.version.hip:
        arch = str(getattr(props, "gcnArchName", ""))
        bf16 = arch.startswith(("gfx90a", "gfx94", "gfx95", "gfx11", "gfx12"))
        return True, bf16, arch.startswith(("gfx94", "gfx95", "gfx12"))
    capability = (props.major, props.minor)
    return capability >= (5, 3), capability >= (8, 0), capability >= (8, 9)


class CudaBackend(TorchModuleBackend):
    """CUDA or ROCm devices; host memory is pinned in place with the runtime's host registration."""

    can_pin = True

    def __init__(self) -> None:
        super().__init__("cuda", "rocm" if torch.version.hip else "cuda", cuda_capabilities)
        self._hidden: dict[object, HiddenDevices | None] = {}

    def hidden_devices(self) -> HiddenDevices | None:
        # Asked at every inventory snapshot (the panel's, several a second): the count is read once per platform, as
        # the driver's GPUs do not change while ComfyUI runs and the management library takes milliseconds to start.
        key = platform()
        if key not in self._hidden:
            self._hidden[key] = _hidden_now()
        return self._hidden[key]

    def pin(self, pointer: int, size: int) -> bool:
        return RUNTIME.register(pointer, size)

    def unpin(self, pointer: int) -> bool:
        return RUNTIME.unregister(pointer)

    def reads_errors(self) -> bool:
        return RUNTIME.reads_errors()

    def take_error(self) -> str | None:
        return RUNTIME.take_error()


def _hidden_now() -> HiddenDevices | None:
    """The GPUs the driver has and this process does not see: the management libraries count every device the
    driver has, whatever the visibility setting says."""
    try:
        if torch.version.hip:
            raw = getattr(torch.cuda, "_raw_device_count_amdsmi", None)
            total = raw() if raw is not None else None
        else:
            total = nvidia_driver_devices()
        visible = torch.cuda.device_count()
    except Exception:  # no management library: nothing to say
        return None
    if total is None or total <= visible:
        return None
    return HiddenDevices(total - visible, total, visibility_setting())
