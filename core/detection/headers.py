"""Read what a model file holds (tensor names, shapes, dtypes, byte offsets) without reading its weights.

* safetensors (``.safetensors``, ``.sft``): the 8-byte header length and the JSON header, validated the way a
  loader relies on it (every offset inside the file, sizes matching shapes, no two tensors overlapping);
* PyTorch pickles (``.ckpt``, ``.pt``, ``.pth``, ``.bin``): only through ``torch.load(weights_only=True)``,
  memory-mapped so no weight is read; a pickle that ``weights_only`` refuses is reported as unsafe, never
  loaded another way;
* GGUF is recognised and refused with a pointer to a GGUF loader (out of scope here).

Every problem raises :class:`~core.errors.ModelFileError` naming the file, what is wrong and what to do.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import pickle
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..errors import ModelFileError, UnsafePickleError, first_line

#: safetensors dtype name -> (bytes per element, torch dtype or None where torch has none).
SAFETENSORS_DTYPES: dict[str, tuple[int, torch.dtype | None]] = {
    "F64": (8, torch.float64),
    "F32": (4, torch.float32),
    "F16": (2, torch.float16),
    "BF16": (2, torch.bfloat16),
    "F8_E4M3": (1, getattr(torch, "float8_e4m3fn", None)),
    "F8_E5M2": (1, getattr(torch, "float8_e5m2", None)),
    "F8_E8M0": (1, getattr(torch, "float8_e8m0fnu", None)),
    "I64": (8, torch.int64),
    "I32": (4, torch.int32),
    "I16": (2, torch.int16),
    "I8": (1, torch.int8),
    "U64": (8, getattr(torch, "uint64", None)),
    "U32": (4, getattr(torch, "uint32", None)),
    "U16": (2, getattr(torch, "uint16", None)),
    "U8": (1, torch.uint8),
    "BOOL": (1, torch.bool),
}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0"})
SAFETENSORS_SUFFIXES = (".safetensors", ".sft")
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit
MAX_DIMS = 64  # torch's limit on a tensor's dimensions
MAX_DIM = 2**48  # no real tensor is larger in any dimension; bigger values are crafted (and overflow int64 math)

_TORCH_TO_NAME = {dtype: name for name, (_, dtype) in SAFETENSORS_DTYPES.items() if dtype is not None}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a file: its shape, stored dtype, and where its bytes are (safetensors only)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int = 0
    end: int = 0

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes as stored."""
        return self.numel * SAFETENSORS_DTYPES[self.dtype][0]

    @property
    def is_float(self) -> bool:
        """True for floating-point tensors (weights), False for integer and boolean ones."""
        return self.dtype in FLOAT_DTYPES


@dataclass(frozen=True)
class FileHeader:
    """Everything known about a model file without reading its weights.

    ``data_start`` is where tensor data begins in a safetensors file (offsets in :class:`TensorInfo` are
    relative to it); 0 for pickles, whose tensors are not at fixed offsets.
    """

    path: str
    format: str
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)
    data_start: int = 0
    file_size: int = 0
    identity: tuple[int, ...] = ()  # device, inode, size, mtime: the reader checks the file is still this one


def read_header(path: str | os.PathLike[str]) -> FileHeader:
    """Read and validate a model file's header.

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
    if magic[:4] == b"GGUF":
        raise ModelFileError(
            f"{file.name} is a GGUF file; Device Control reads safetensors and PyTorch checkpoints. "
            "Load GGUF files with a GGUF loader pack (e.g. ComfyUI-GGUF)."
        )
    identity = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    zipped = magic[:4] == b"PK\x03\x04" and file.suffix.lower() not in SAFETENSORS_SUFFIXES
    if zipped or file.suffix.lower() in PICKLE_SUFFIXES:
        return replace(_read_pickle(file, size), identity=identity)
    return replace(_read_safetensors(file, size), identity=identity)


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
    _check_overlaps(file, tensors)
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


def _check_overlaps(file: Path, tensors: dict[str, TensorInfo]) -> None:
    ordered = sorted((t for t in tensors.values() if t.end > t.begin), key=lambda t: t.begin)
    for before, after in itertools.pairwise(ordered):
        if after.begin < before.end:
            raise _broken(file, f"tensors {before.name!r} and {after.name!r} overlap in the file")


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
