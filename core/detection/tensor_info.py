"""What a model file holds, described without its weights: each tensor's name, dtype, shape and byte range
(:class:`TensorInfo`), and the file's (:class:`FileHeader`), as the safetensors, pickle and GGUF readers
(``headers``, ``gguf_header``) give them. A GGUF tensor's dtype is its GGML type's name (``Q4_K``; ``F16``,
``BF16`` and ``F32`` are the same names in both formats).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ModelFileError
from .ggml_types import GGML_TYPES

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
MAX_DIM = 2**48  # no real tensor is larger in any dimension; bigger values are crafted (and overflow int64 math)


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
        """Bytes as stored (a GGUF tensor's in its GGML blocks)."""
        if self.dtype in SAFETENSORS_DTYPES:
            return self.numel * SAFETENSORS_DTYPES[self.dtype][0]
        return GGML_TYPES[self.dtype].nbytes(self.numel)

    @property
    def is_quantized(self) -> bool:
        """True for a GGUF tensor in GGML blocks: it keeps its bytes in any dtype chosen for the model."""
        return self.dtype not in SAFETENSORS_DTYPES

    @property
    def is_float(self) -> bool:
        """True for floating-point tensors (weights, quantised ones included), False for integer and boolean ones."""
        return self.dtype in FLOAT_DTYPES or self.dtype in GGML_TYPES


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


def check_overlaps(file: Path, tensors: dict[str, TensorInfo], broken: Callable[[Path, str], ModelFileError]) -> None:
    """Raise ``broken(file, ...)`` where two tensors share bytes of the file."""
    ordered = sorted((t for t in tensors.values() if t.end > t.begin), key=lambda t: t.begin)
    for before, after in itertools.pairwise(ordered):
        if after.begin < before.end:
            raise broken(file, f"tensors {before.name!r} and {after.name!r} overlap in the file")
