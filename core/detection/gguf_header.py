"""The header of a GGUF file (the GGML project's format, version 2 and 3): its tensors' names, shapes, GGML types
and byte ranges, and its scalar metadata, read without reading a weight.

The layout (all little-endian): ``GGUF``, a version, the tensor and metadata counts; the metadata as key, value
type and value (arrays carry their element type and count); then per tensor its name, dimension count, dimensions
(innermost first), GGML type and offset; the data starts at the next multiple of ``general.alignment`` (32 when
absent). Shapes are turned outermost first, as torch and safetensors write them. GGML's own code holds four
dimensions at most, but the ``gguf`` package's writer writes any count, and ComfyUI-GGUF's tools use that: their
``fix_5d_tensors.py`` puts a video model's five-dimensional patch embedding (Wan, Hunyuan Video) back into the
quantised file as a plain F32 tensor of five dimensions, so more than four are read here (up to torch's limit).
Their converter also reshapes some tensors of SD1.5 and SDXL to rows of 256 values and records the shape under
``comfy.gguf.orig_shape.<name>``: that shape is the one given here. A text encoder converted by llama.cpp gets
ComfyUI's tensor names (:mod:`.gguf_names`).

Everything is validated before a caller relies on it, as the safetensors reader does: counts and string lengths
against the file's size (a crafted count never makes us allocate), every range inside the file, aligned, the
size its shape and type need, no two tensors overlapping, every type one we dequantise
(:mod:`.ggml_types`). Problems raise :class:`~core.errors.ModelFileError` naming the file and the fix.
"""

from __future__ import annotations

import math
import struct
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

from ..errors import ModelFileError
from .ggml_types import ggml_type
from .gguf_names import comfy_names
from .tensor_info import MAX_DIM, FileHeader, TensorInfo, check_overlaps

#: A shape ComfyUI's GGUF converters could not keep in four dimensions, by tensor name after this prefix.
ORIG_SHAPE = "comfy.gguf.orig_shape."
#: The most dimensions a tensor may have: torch's limit (GGML computes with four; ComfyUI-GGUF's files hold five).
MAX_DIMS = 64
DEFAULT_ALIGNMENT = 32
#: Value types (``gguf_type``) by number: the struct format of a scalar, or the name of a compound one.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Reads the header's fields in order, refusing to read past the file's end."""

    def __init__(self, handle: IO[bytes], file: Path, size: int) -> None:
        self.handle, self.file, self.size = handle, file, size

    def bytes(self, count: int) -> bytes:
        if count > self.size - self.handle.tell():
            raise broken(self.file, f"the header runs past the end of the file ({self.size} bytes)")
        return self.handle.read(count)

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.bytes(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.bytes(self.unpack("<Q"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise broken(self.file, f"a name at byte {self.handle.tell() - len(raw)} is not UTF-8 text") from exc

    def value(self, kind: int, depth: int = 0) -> Any:
        """One metadata value (an array with all its elements)."""
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY and depth == 0:
            element, count = self.unpack("<I"), self.unpack("<Q")
            if count > self.size:
                raise broken(self.file, f"an array claims {count} elements, more than the file has bytes")
            return [self.value(element, 1) for _ in range(count)]
        raise broken(self.file, f"a metadata value has the unknown type {kind}")


def broken(file: Path, problem: str) -> ModelFileError:
    """The error of a GGUF file that cannot be what it claims."""
    return ModelFileError(
        f"{file.name} is not a valid GGUF file: {problem}. The file is damaged or incomplete: download it again "
        "(or convert it again), then refresh ComfyUI's model list."
    )


def read_gguf_header(file: Path, size: int) -> FileHeader:
    """The header of the GGUF file ``file`` of ``size`` bytes (see the module's docstring).

    Raises:
        ModelFileError: a version other than 2 and 3, a truncated or garbled header, a tensor outside the file or
            overlapping another, or a tensor type Device Control does not dequantise (the tensor is named).
    """
    metadata, entries, header_end = _read_fields(file, size)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise broken(file, f"its alignment {alignment!r} is not a power of two")
    data_start = -(-header_end // alignment) * alignment
    tensors = _with_comfy_names({entry[0]: _tensor_info(file, *entry, metadata) for entry in entries}, metadata)
    for info in tensors.values():
        if info.begin % alignment or data_start + info.end > size:
            raise broken(file, f"tensor {info.name!r} lies outside the file or off its {alignment}-byte alignment")
    check_overlaps(file, tensors, broken)
    shown = {k: str(v) for k, v in metadata.items() if not isinstance(v, list)}
    return FileHeader(str(file), "gguf", tensors, shown, data_start, size)


def read_gguf_metadata(file: Path) -> dict[str, Any]:
    """Every metadata entry of the GGUF file ``file``, arrays included (a tokenizer's pieces: what
    :func:`read_gguf_header` leaves out).

    Raises:
        ModelFileError: the header is broken (as for :func:`read_gguf_header`).
    """
    return _read_fields(file, file.stat().st_size)[0]


def _with_comfy_names(tensors: dict[str, TensorInfo], metadata: dict[str, Any]) -> dict[str, TensorInfo]:
    """``tensors`` under ComfyUI's names where the file is a llama.cpp text encoder we map (the same bytes)."""
    renamed = comfy_names(metadata.get("general.architecture"), tensors)
    if renamed is None:
        return tensors
    return {renamed[name]: replace(info, name=renamed[name]) for name, info in tensors.items()}


def _read_fields(file: Path, size: int) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]], int]:
    """The metadata, each tensor's raw entry (name, dimensions innermost first, type, offset) and where they end."""
    with open(file, "rb") as handle:
        cursor = _Cursor(handle, file, size)
        magic = cursor.bytes(4)
        if magic != b"GGUF":
            raise broken(file, f"its magic is {magic!r}, where a GGUF file starts with b'GGUF'")
        version = cursor.unpack("<I")
        if version not in (2, 3):
            raise broken(file, f"it is GGUF version {version}; Device Control reads versions 2 and 3")
        tensor_count, kv_count = cursor.unpack("<Q"), cursor.unpack("<Q")
        if tensor_count > size or kv_count > size:
            raise broken(file, f"it claims {tensor_count} tensors and {kv_count} metadata entries")
        metadata = {}
        for _ in range(kv_count):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.unpack("<I"))
        entries = [_tensor_entry(cursor) for _ in range(tensor_count)]
        return metadata, entries, handle.tell()


def _tensor_entry(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string()
    count = cursor.unpack("<I")
    if count > MAX_DIMS:
        raise broken(cursor.file, f"tensor {name!r} claims {count} dimensions, more than a tensor can have")
    dims = tuple(cursor.unpack("<Q") for _ in range(count))
    if any(d > MAX_DIM for d in dims):
        raise broken(cursor.file, f"tensor {name!r} has the impossible shape {dims}")
    return name, dims, cursor.unpack("<I"), cursor.unpack("<Q")


def _tensor_info(file: Path, name: str, dims: tuple[int, ...], kind: int, offset: int, metadata: dict) -> TensorInfo:
    blocks = ggml_type(kind, f"tensor {name!r} of {file.name}")
    shape = tuple(reversed(dims))
    if shape and shape[-1] % blocks.values:
        raise broken(file, f"tensor {name!r} ({blocks.name}, shape {shape}) is not a whole number of blocks")
    original = metadata.get(ORIG_SHAPE + name)
    if isinstance(original, list) and all(isinstance(d, int) and 0 <= d <= MAX_DIM for d in original):
        if math.prod(original) != math.prod(shape):
            raise broken(file, f"tensor {name!r} is recorded as shape {tuple(original)} but holds shape {shape}")
        shape = tuple(original)
    nbytes = blocks.nbytes(math.prod(shape))
    return TensorInfo(name, blocks.name, shape, offset, offset + nbytes)
