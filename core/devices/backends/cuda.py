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
        # A failure leaves its error as the runtime's last one, which the next kernel launch's check reports as its
        # own (seen on an H100: "part or all of the requested memory range is already mapped" raised by a forward
        # after a failed registration): the caller reads it back with take_error.
        return _code(torch.cuda.cudart().cudaHostRegister(pointer, size, _REGISTER_PORTABLE)) == 0

    def unpin(self, pointer: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(pointer)

    def take_error(self) -> str | None:
        return _take_last_error(torch.cuda.cudart())


def _code(result: Any) -> int:
    """A CUDA runtime call's result as a number (torch's binding returns its ``cudaError`` enum)."""
    return int(getattr(result, "value", result))


def _take_last_error(cudart: Any) -> str | None:
    """Read and clear the CUDA runtime's last error (``cudaGetLastError``): through torch's binding where it has the
    call (torch 2.14 has not), else through the runtime library this process loaded (found in its memory map, so it
    is the instance torch uses); its text, or ``None`` when there was none or it cannot be read."""
    last = getattr(cudart, "cudaGetLastError", None) or _runtime_call("cudaGetLastError")
    if last is None:
        return None
    code = _code(last())
    if code == 0:
        return None
    describe = _runtime_call("cudaGetErrorString")
    if describe is None:
        return f"CUDA error {code}"
    describe.restype = ctypes.c_char_p
    return describe(code).decode(errors="replace")


def _runtime_call(name: str) -> Any | None:
    """Function ``name`` of the CUDA runtime library loaded in this process, or ``None`` where none is found."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
        return next((getattr(ctypes.CDLL(path), name) for path in sorted(paths)), None)
    except (OSError, AttributeError):
        return None
