"""NVIDIA CUDA, and AMD ROCm (HIP builds of torch present ROCm devices as ``cuda``)."""

from __future__ import annotations

from typing import Any

import torch

from .torch_module import TorchModuleBackend

#: ``cudaHostRegisterPortable``: the pinned range is usable from every device.
_REGISTER_PORTABLE = 1


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

    def pin(self, pointer: int, size: int) -> bool:
        return torch.cuda.cudart().cudaHostRegister(pointer, size, _REGISTER_PORTABLE) == 0

    def unpin(self, pointer: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(pointer)
