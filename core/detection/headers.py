"""Read what a model file holds (tensor names, shapes, dtypes, byte offsets) without reading its weights.

* safetensors (``.safetensors``, ``.sft``): the 8-byte header length and the JSON header, validated the way a
  loader relies on it (every offset inside the file, sizes matching shapes, no two tensors overlapping);
* PyTorch pickles (``.ckpt``, ``.pt``, ``.pth``, ``.bin``): only through ``torch.load(weights_only=True)``,
  memory-mapped so no weight is read; a pickle that ``weights_only`` refuses is reported as unsafe, never
  loaded another way;
* GGUF (``.gguf``, or any file starting with ``GGUF``): its header through ``gguf_header``, for detection; a file
  named ``.gguf`` is judged as a GGUF whatever it starts with, so a damaged one is called a damaged GGUF (a
  ``.safetensors`` file is judged by its content); the loaders refuse it, naming what it
  holds and pointing to the loader that reads it (Load Diffusion Model With Device and Load Text Encoders With
  Device read GGUF files).

Every problem raises :class:`~core.errors.ModelFileError` naming the file, what is wrong and what to do.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
from dataclasses import replace
from pathlib import Path

import torch

from ..errors import ModelFileError, UnsafePickleError, first_line
from .gguf_header import read_gguf_header
from .tensor_info import (
    FLOAT_DTYPES,
    MAX_DIM,
    SAFETENSORS_DTYPES,
    FileHeader,
    TensorInfo,
    check_overlaps,
)

#: Re-exported: what a file holds is described by ``tensor_info``'s types, which callers import from here.
__all__ = [
    "FLOAT_DTYPES",
    "MAX_DIM",
    "SAFETENSORS_DTYPES",
    "FileHeader",
    "TensorInfo",
    "check_overlaps",
    "load_pickled_state",
    "read_header",
]

SAFETENSORS_SUFFIXES = (".safetensors", ".sft")
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit
MAX_DIMS = 64  # torch's limit on a tensor's dimensions
_TORCH_TO_NAME = {dtype: name for name, (_, dtype) in SAFETENSORS_DTYPES.items() if dtype is not None}


def read_header(path: str | os.PathLike[str], gguf: bool = False) -> FileHeader:
    """Read and validate a model file's header; a GGUF file's only where ``gguf`` is true (the loaders that
    read GGUF and detection say so; the others refuse one, naming the loader that takes it).

    Raises:
        ModelFileError: the file is missing, empty, a directory, truncated, garbled, or of an unsupported
            format; the message names the file and the fix.
        UnsafePickleError: a pickle that ``torch.load(weights_only=True)`` refuses.
    """
    file = Path(path)
    if file.is_dir():
        raise ModelFileError(f"{file} is a directory, not a model file; pick a .safetensors file inside it.")
    if not file.exists():
        raise ModelFileError(f"{file} does not exist; check the name, or refresh ComfyUI's model list (press R).")
    stat = file.stat()
    size = stat.st_size
    if size == 0:
        raise ModelFileError(f"{file.name} is empty (0 bytes); the download or copy failed: fetch it again.")
    with open(file, "rb") as handle:
        magic = handle.read(8)
    identity = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if magic[:4] == b"GGUF" or file.suffix.lower() == ".gguf":  # a damaged .gguf is named a damaged GGUF
        return replace(_gguf(file, size, gguf), identity=identity)
    zipped = magic[:4] == b"PK\x03\x04" and file.suffix.lower() not in SAFETENSORS_SUFFIXES
    if zipped or file.suffix.lower() in PICKLE_SUFFIXES:
        return replace(_read_pickle(file, size), identity=identity)
    return replace(_read_safetensors(file, size), identity=identity)


def _gguf(file: Path, size: int, wanted: bool) -> FileHeader:
    """A GGUF file's header where ``wanted``; otherwise the refusal, naming what the file holds."""
    header = read_gguf_header(file, size)
    if wanted:
        return header
    kinds = "/".join(sorted({t.dtype for t in header.tensors.values()}))
    architecture = header.metadata.get("general.architecture", "an unnamed architecture")
    raise ModelFileError(
        f"{file.name} is a GGUF file ({architecture}, {len(header.tensors)} tensors in {kinds}), which this loader "
        "does not read: a GGUF diffusion model goes into Load Diffusion Model With Device (from the "
        "diffusion_models or unet folder)."
    )


def _broken(file: Path, problem: str) -> ModelFileError:
    return ModelFileError(
        f"{file.name} is not a valid safetensors file: {problem}. The file is damaged or incomplete: "
        "download it again (or re-convert it), then refresh ComfyUI's model list."
    )


def _read_safetensors(file: Path, size: int) -> FileHeader:
    if size < 8:
        raise _broken(file, f"it has only {size} bytes, fewer than the 8-byte header length")
    with open(file, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        if header_len > size - 8:
            raise _broken(file, f"its header length ({header_len} bytes) runs past the end of the file ({size} bytes)")
        if header_len > MAX_HEADER_BYTES:
            raise _broken(file, f"its header length ({header_len} bytes) is over the format's 100 MB limit")
        raw = handle.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _broken(file, f"its JSON header cannot be parsed ({type(exc).__name__}: {exc})") from exc
    if not isinstance(header, dict):
        raise _broken(file, "its JSON header is not an object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise _broken(file, "its __metadata__ is not an object")
    data_start = 8 + header_len
    data_size = size - data_start
    tensors = {name: _tensor_info(file, name, entry, data_size) for name, entry in header.items()}
    check_overlaps(file, tensors, _broken)
    metadata = {str(k): str(v) for k, v in metadata.items()}
    return FileHeader(str(file), "safetensors", tensors, metadata, data_start, size)


def _tensor_info(file: Path, name: str, entry: object, data_size: int) -> TensorInfo:
    problem = _entry_problem(name, entry)
    if problem is not None:
        raise _broken(file, problem)
    begin, end = entry["data_offsets"]
    info = TensorInfo(name, entry["dtype"], tuple(entry["shape"]), begin, end)
    if end < begin or end > data_size:
        raise _broken(file, f"tensor {name!r} has offsets {[begin, end]} outside the {data_size} bytes of data")
    if end - begin != info.nbytes:
        raise _broken(file, f"tensor {name!r} spans {end - begin} bytes but its shape and dtype need {info.nbytes}")
    return info


def _entry_problem(name: str, entry: object) -> str | None:
    """What is wrong with a header entry's form (its dtype, shape and offsets), or ``None``."""
    if not isinstance(entry, dict):
        return f"the entry for tensor {name!r} is not an object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
        return f"tensor {name!r} has unknown dtype {dtype!r}"
    if not _is_counts(shape, MAX_DIM, MAX_DIMS):
        return f"tensor {name!r} has an invalid shape {shape!r}"
    if not _is_counts(offsets, 2**63, 2) or len(offsets) != 2:
        return f"tensor {name!r} has invalid data offsets {offsets!r}"
    return None


def _is_counts(values: object, limit: int, most: int) -> bool:
    """A list of at most ``most`` whole numbers from 0 to below ``limit``."""
    return isinstance(values, list) and len(values) <= most and all(_is_count(v, limit) for v in values)


def _is_count(value: object, limit: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < limit


def load_pickled_state(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The tensors of a PyTorch pickle, memory-mapped (no weight is read until used), loaded safely.

    Raises:
        UnsafePickleError: ``torch.load(weights_only=True)`` refuses the file.
        ModelFileError: the file is damaged or holds no tensors.
    """
    file = Path(path)
    try:
        loaded = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        raise _unsafe(file, exc) from exc
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise ModelFileError(f"{file.name} cannot be read as a PyTorch checkpoint ({first_line(exc)}).") from exc
        try:  # files saved before torch 1.6 cannot be memory-mapped; read them whole
            loaded = torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as inner:
            raise _unsafe(file, inner) from inner
    except (EOFError, OSError, ValueError) as exc:
        raise ModelFileError(
            f"{file.name} cannot be read as a PyTorch checkpoint ({first_line(exc)}); it is damaged or not a "
            "model file: download it again."
        ) from exc
    state = _state_dict_of(loaded)
    if state is None:
        raise ModelFileError(f"{file.name} holds no tensors (a PyTorch file, but not a model's weights).")
    return state


def _unsafe(file: Path, exc: BaseException) -> UnsafePickleError:
    return UnsafePickleError(
        f"{file.name} is an unsafe pickle: torch.load(weights_only=True) refuses it ({first_line(exc)}). "
        "Loading it anyway could run code hidden in the file, so Device Control will not. Convert it to "
        ".safetensors with a tool you trust, or use a safetensors release of the model."
    )


def _read_pickle(file: Path, size: int) -> FileHeader:
    state = load_pickled_state(file)
    tensors = {
        name: TensorInfo(name, _TORCH_TO_NAME.get(t.dtype, str(t.dtype)), tuple(t.shape))
        for name, t in state.items()
        if isinstance(t, torch.Tensor)
    }
    return FileHeader(str(file), "pickle", tensors, {}, 0, size)


def _state_dict_of(loaded: object) -> dict[str, torch.Tensor] | None:
    if isinstance(loaded, dict):
        for wrapper in ("state_dict", "model", "module"):
            inner = loaded.get(wrapper)
            if isinstance(inner, dict) and any(isinstance(v, torch.Tensor) for v in inner.values()):
                return inner
        if any(isinstance(v, torch.Tensor) for v in loaded.values()):
            return loaded
    return None
