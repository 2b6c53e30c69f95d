"""Stream weights from a model file straight into tensors that are already where they will stay.

ComfyUI reads a whole checkpoint into memory and then copies it into a model built in its compute dtype, so
for a while both live in RAM. Here each tensor is read from the file directly into its final tensor (already
allocated in the target dtype, on the target device): when the stored dtype is the target dtype and the
target is host memory, the bytes go from the file into the final tensor with no copy at all; otherwise they
pass through one staging buffer, reused for every tensor, so the extra memory is at most the largest tensor.

Positional reads are used rather than a memory map: pages of a mapped file count in the process's resident
memory while mapped, which would double the peak for a full load; plain reads leave them in the kernel's page
cache instead, where they cost nothing the process has to account for.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from .errors import ModelFileError
from .headers import SAFETENSORS_DTYPES, FileHeader, TensorInfo, load_pickled_state

#: Called as ``progress(bytes_done, bytes_total)`` after every tensor; it may raise to stop the load
#: (ComfyUI's interruption does), and the load stops cleanly between two tensors.
ProgressCallback = Callable[[int, int], None]


class WeightReader:
    """Reads tensors of one model file by name. Use as a context manager (it holds the file open).

    Args:
        header: the file's header, from :func:`core.headers.read_header`.
        pin_staging: pin the staging buffer (faster host-to-GPU copies); falls back to pageable memory
            when pinning fails.
    """

    def __init__(self, header: FileHeader, *, pin_staging: bool = False) -> None:
        self.header = header
        self.pin_staging = pin_staging
        self._fd: int | None = None
        self._pickled: dict[str, torch.Tensor] | None = None
        self._staging = torch.empty(0, dtype=torch.uint8)

    def __enter__(self) -> WeightReader:
        if self.header.format == "safetensors":
            self._fd = os.open(self.header.path, os.O_RDONLY)
        else:
            self._pickled = load_pickled_state(self.header.path)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._pickled = None
        self._staging = torch.empty(0, dtype=torch.uint8)

    def info(self, name: str) -> TensorInfo:
        """The header entry of tensor ``name``."""
        try:
            return self.header.tensors[name]
        except KeyError:
            raise ModelFileError(f"{os.path.basename(self.header.path)} has no tensor {name!r}.") from None

    def read_into(self, name: str, dest: torch.Tensor) -> None:
        """Fill ``dest`` (any dtype, any device, same number of elements) with tensor ``name`` of the file."""
        info = self.info(name)
        if info.numel != dest.numel():
            raise ModelFileError(
                f"{os.path.basename(self.header.path)}: tensor {name!r} has shape {list(info.shape)}, but the "
                f"model expects {list(dest.shape)}; the file belongs to another model variant."
            )
        if self._pickled is not None:
            with torch.no_grad():
                dest.copy_(self._pickled[name].reshape(dest.shape))
            return
        stored = _torch_dtype(info)
        if dest.device.type == "cpu" and dest.dtype == stored and dest.is_contiguous() and type(dest) is torch.Tensor:
            self._pread_into(info, dest.reshape(-1).view(torch.uint8))
            return
        source = self._stage(info).view(stored).reshape(dest.shape)
        with torch.no_grad():
            dest.copy_(source)

    def read(self, name: str) -> torch.Tensor:
        """A new host tensor holding tensor ``name`` in its stored dtype (for the few keys that need a transform)."""
        info = self.info(name)
        if self._pickled is not None:
            return self._pickled[name].clone()
        out = torch.empty(info.shape, dtype=_torch_dtype(info))
        self.read_into(name, out)
        return out

    def _stage(self, info: TensorInfo) -> torch.Tensor:
        if self._staging.numel() < info.nbytes:
            self._staging = _allocate_staging(info.nbytes, self.pin_staging)
        staging = self._staging[: info.nbytes]
        self._pread_into(info, staging)
        return staging

    def _pread_into(self, info: TensorInfo, buffer: torch.Tensor) -> None:
        view = memoryview(buffer.numpy()).cast("B")
        position = self.header.data_start + info.begin
        done = 0
        while done < len(view):
            count = os.preadv(self._fd, [view[done:]], position + done)
            if count == 0:
                raise ModelFileError(
                    f"{os.path.basename(self.header.path)} ended while reading {info.name!r}: the file was truncated "
                    "or replaced while loading. Download it again."
                )
            done += count


def _torch_dtype(info: TensorInfo) -> torch.dtype:
    dtype = SAFETENSORS_DTYPES[info.dtype][1]
    if dtype is None:
        raise ModelFileError(f"tensor {info.name!r} is stored as {info.dtype}, which this torch version cannot hold.")
    return dtype


def _allocate_staging(nbytes: int, pin: bool) -> torch.Tensor:
    if pin:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:  # no pinning on this platform or out of pinnable memory: pageable works too
            pass
    return torch.empty(nbytes, dtype=torch.uint8)
