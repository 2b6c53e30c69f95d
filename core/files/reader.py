"""Stream weights from a model file straight into tensors that are already where they will stay.

ComfyUI maps a whole checkpoint into memory and then copies it into a model built in its compute dtype; the
mapped file's pages count in the process's memory until the load ends, so for a while both are resident.
Here each tensor goes from the file directly into its final tensor (already allocated in the target dtype,
on the target device):

* stored dtype = target dtype, target in host memory: one positional read straight into the final tensor;
* a dtype conversion: the converting copy reads the memory-mapped file directly, then the pages it read are
  released from the process (``madvise(DONTNEED)``; the kernel's page cache keeps them), so at most one
  tensor's worth of the file is ever resident beside the model; conversions torch is slow at directly go
  through float32 in small steps (``core.files.converting``), with the same result;
* another device: through one staging buffer (pinned when asked), reused for every tensor.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from ..detection.headers import SAFETENSORS_DTYPES, FileHeader, TensorInfo, load_pickled_state
from ..devices.backends import Target
from ..devices.host_memory import map_file, page_block, read_at, release_file_pages
from ..devices.pinned import pinned_memory
from ..errors import ModelFileError
from .converting import Float32Steps

#: Called as ``progress(bytes_done, bytes_total)`` after every tensor; it may raise to stop the load
#: (ComfyUI's interruption does), and the load stops cleanly between two tensors.


class WeightReader:
    """Reads tensors of one model file by name. Use as a context manager (it holds the file open).

    Args:
        header: the file's header, from :func:`core.headers.read_header`.
        pin_for: page-lock the staging buffer for copies to this device (faster host-to-GPU copies), where the
            pinned-memory books allow (``core.devices.pinned``); pageable otherwise.
    """

    def __init__(self, header: FileHeader, *, pin_for: Target | None = None) -> None:
        self.header = header
        self.pin_for = pin_for
        self._fd: int | None = None
        self._map: Any = None
        self._pickled: dict[str, torch.Tensor] | None = None
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._steps = Float32Steps()

    def __enter__(self) -> WeightReader:
        if self.header.format not in ("safetensors", "gguf"):  # a GGUF's tensors are at fixed offsets too
            self._pickled = load_pickled_state(self.header.path)
            return self
        try:
            self._fd = os.open(self.header.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except FileNotFoundError as exc:
            raise ModelFileError(
                f"{os.path.basename(self.header.path)} is gone: it was deleted or moved after its header was read. "
                "Put it back (or choose another file) and queue the prompt again."
            ) from exc
        if _identity(os.fstat(self._fd)) != self.header.identity:
            os.close(self._fd)
            self._fd = None
            raise ModelFileError(
                f"{os.path.basename(self.header.path)} changed after its header was read (replaced or rewritten "
                "while the prompt ran); queue the prompt again."
            )
        if self.header.file_size > 0:  # None where pages cannot be given back: the staging path serves every read
            self._map = map_file(self._fd)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._pickled = None
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._steps.release()

    def info(self, name: str) -> TensorInfo:
        """The header entry of tensor ``name``."""
        try:
            return self.header.tensors[name]
        except KeyError:
            raise ModelFileError(f"{os.path.basename(self.header.path)} has no tensor {name!r}.") from None

    def file_name(self, _name: str) -> str:
        """The name of the file that holds tensor ``_name`` (this reader's), for messages."""
        return os.path.basename(self.header.path)

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
        elif dest.device.type == "cpu" and type(dest) is torch.Tensor:
            self._read_on_host(info, dest)
        else:
            with torch.no_grad():
                dest.copy_(self._stage(info).view(_torch_dtype(info)).reshape(dest.shape))

    def _read_on_host(self, info: TensorInfo, dest: torch.Tensor) -> None:
        """Into host memory: straight from the file when the dtype is the same, else converted from the mapping."""
        stored = _torch_dtype(info)
        start = self.header.data_start + info.begin
        if dest.dtype == stored and dest.is_contiguous():
            self._pread_into(info, dest.reshape(-1).view(torch.uint8))
        elif self._map is not None and start % stored.itemsize == 0 and info.nbytes:
            self._convert_from_map(info, start, stored, dest)
        else:
            self._steps.copy(dest, self._stage(info).view(stored))

    def _convert_from_map(self, info: TensorInfo, start: int, stored: torch.dtype, dest: torch.Tensor) -> None:
        self._check_within_file(info, start)
        with warnings.catch_warnings():  # the mapping is read-only and only ever read: torch's warning is moot
            warnings.simplefilter("ignore", UserWarning)
            mapped = torch.frombuffer(self._map, dtype=torch.uint8, count=info.nbytes, offset=start)
        try:
            self._steps.copy(dest, mapped.view(stored))
        finally:
            del mapped  # never leave a tensor pointing into the mapping once it may be closed
        release_file_pages(self._map, start, info.nbytes)

    def _check_within_file(self, info: TensorInfo, start: int) -> None:
        size = os.fstat(self._fd).st_size
        if start + info.nbytes > size or size < self.header.file_size:
            raise ModelFileError(
                f"{os.path.basename(self.header.path)} ended while reading {info.name!r}: the file was truncated "
                "or replaced while loading. Download it again."
            )

    def read_blocks_into(self, name: str, dest: torch.Tensor) -> None:
        """Fill ``dest`` (a contiguous ``uint8`` tensor of the tensor's size, on any device) with the stored bytes
        of tensor ``name``: a quantised GGUF tensor's GGML blocks, kept as they are."""
        info = self.info(name)
        if dest.dtype != torch.uint8 or dest.numel() != info.nbytes or not dest.is_contiguous():
            raise ModelFileError(
                f"{os.path.basename(self.header.path)}: tensor {name!r} holds {info.nbytes} bytes of {info.dtype}, "
                f"which cannot go into {dest.numel()} {dest.dtype} values; the file belongs to another model variant."
            )
        if dest.device.type == "cpu" and type(dest) is torch.Tensor:
            self._pread_into(info, dest.reshape(-1))
        else:
            with torch.no_grad():
                dest.copy_(self._stage(info).reshape(dest.shape))

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
            self._staging = _allocate_staging(info.nbytes, self.pin_for)
        staging = self._staging[: info.nbytes]
        self._pread_into(info, staging)
        return staging

    def _pread_into(self, info: TensorInfo, buffer: torch.Tensor) -> None:
        view = memoryview(buffer.numpy()).cast("B")
        position = self.header.data_start + info.begin
        done = 0
        while done < len(view):
            count = read_at(self._fd, view[done:], position + done)
            if count == 0:
                raise ModelFileError(
                    f"{os.path.basename(self.header.path)} ended while reading {info.name!r}: the file was truncated "
                    "or replaced while loading. Download it again."
                )
            done += count


def _identity(stat: os.stat_result) -> tuple[int, int, int, int]:
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


def _torch_dtype(info: TensorInfo) -> torch.dtype:
    if info.dtype not in SAFETENSORS_DTYPES:
        raise ModelFileError(
            f"tensor {info.name!r} is quantised ({info.dtype}) and goes into a layer that cannot dequantise it; "
            "report the model's layout (the layer type holding it)."
        )
    dtype = SAFETENSORS_DTYPES[info.dtype][1]
    if dtype is None:
        raise ModelFileError(f"tensor {info.name!r} is stored as {info.dtype}, which this torch version cannot hold.")
    return dtype


def _allocate_staging(nbytes: int, pin_for: Target | None) -> torch.Tensor:
    """A staging buffer of ``nbytes``: page-locked for copies to ``pin_for`` where the books allow (unlocked when
    it is dropped), else pageable."""
    if pin_for is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    block = page_block(nbytes)
    pinned_memory().lock(block, pin_for)
    return block
