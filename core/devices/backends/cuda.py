"""NVIDIA CUDA, and AMD ROCm (HIP builds of torch present ROCm devices as ``cuda``)."""

from __future__ import annotations

import ctypes
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
        cudart = torch.cuda.cudart()
        if cudart.cudaHostRegister(pointer, size, _REGISTER_PORTABLE) == 0:
            return True
        # The failed call left its error as the runtime's last one, which the next kernel launch's check reports
        # as its own (seen on an H100: "part or all of the requested memory range is already mapped" raised by a
        # forward after a failed registration). Read it back, which clears it.
        _clear_last_error(cudart)
        return False

    def unpin(self, pointer: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(pointer)


def _clear_last_error(cudart: Any) -> None:
    """Clear the CUDA runtime's last error: through torch's binding where it has the call, else through the runtime
    library this process loaded (found in its memory map, so it is the same instance torch uses)."""
    clear = getattr(cudart, "cudaGetLastError", None)
    if clear is None:
        clear = _runtime_call("cudaGetLastError")
    if clear is not None:
        clear()


def _runtime_call(name: str) -> Any | None:
    """Function ``name`` of the CUDA runtime library loaded in this process, or ``None`` where none is found."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
        return next((getattr(ctypes.CDLL(path), name) for path in sorted(paths)), None)
    except (OSError, AttributeError):
        return None
