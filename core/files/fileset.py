"""Several model files read as one, for a model built from several files (a text encoder pair, say).

A model's weights are traced to file tensors by name (``core.files.lineage``); when they come from several files,
two files may hold tensors of the same name. Each file's names are therefore qualified with the file's place in
the set (:func:`qualified`), and :class:`FileSet` reads a qualified name from the file it belongs to, with the
same interface as :class:`~core.files.reader.WeightReader`.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack

import torch

from ..detection.headers import FileHeader, TensorInfo
from ..devices.backends import Target
from ..errors import ModelFileError
from .reader import WeightReader

_SEPARATOR = "|"


def qualified(index: int, name: str) -> str:
    """The name tensor ``name`` of the ``index``-th file has in a :class:`FileSet`."""
    return f"{index}{_SEPARATOR}{name}"


class FileSet:
    """Reads tensors of several files by qualified name. Use as a context manager (it holds the files open).

    Args:
        headers: the files' headers, in the order their names are qualified with.
        pin_for: page-lock the staging buffers for copies to this device (see :class:`~core.files.reader.WeightReader`).
    """

    def __init__(self, headers: Sequence[FileHeader], *, pin_for: Target | None = None) -> None:
        self.readers = [WeightReader(header, pin_for=pin_for) for header in headers]
        self._stack = ExitStack()

    def __enter__(self) -> FileSet:
        with ExitStack() as opening:  # a file that cannot be opened closes the ones opened before it
            for reader in self.readers:
                opening.enter_context(reader)
            self._stack = opening.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _split(self, name: str) -> tuple[WeightReader, str]:
        index, separator, inner = name.partition(_SEPARATOR)
        if not separator or not index.isdigit() or int(index) >= len(self.readers):
            raise ModelFileError(f"no file of this set holds a tensor named {name!r}.")
        return self.readers[int(index)], inner

    def info(self, name: str) -> TensorInfo:
        """The header entry of the tensor with qualified name ``name``."""
        reader, inner = self._split(name)
        return reader.info(inner)

    def read_into(self, name: str, dest: torch.Tensor) -> None:
        """Fill ``dest`` with the tensor of qualified name ``name`` (see ``WeightReader.read_into``)."""
        reader, inner = self._split(name)
        reader.read_into(inner, dest)

    def read(self, name: str) -> torch.Tensor:
        """A new host tensor holding the tensor of qualified name ``name``, in its stored dtype."""
        reader, inner = self._split(name)
        return reader.read(inner)

    def read_blocks_into(self, name: str, dest: torch.Tensor) -> None:
        """Fill ``dest`` with the GGML blocks of the tensor of qualified name ``name`` (a GGUF file's, kept
        quantised: see ``WeightReader.read_blocks_into``)."""
        reader, inner = self._split(name)
        reader.read_blocks_into(inner, dest)

    def file_name(self, name: str) -> str:
        """The name of the file that holds the tensor of qualified name ``name``, for messages."""
        reader, inner = self._split(name)
        return reader.file_name(inner)
