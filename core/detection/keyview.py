"""A read-only view of a file's tensor names and shapes under a key prefix: what detection rules look at."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from .headers import TensorInfo


class KeyView:
    """Tensor names and shapes seen through a prefix (``"model.diffusion_model."``, or ``""``).

    Rules written against a view use names relative to the prefix, so one rule serves a full checkpoint and
    a diffusion-model-only file alike. ``root_has`` looks at the whole file (top-level marker keys such as
    ``v_pred`` sit outside the prefix).
    """

    def __init__(
        self, tensors: Mapping[str, TensorInfo], prefix: str = "", metadata: Mapping[str, str] | None = None
    ) -> None:
        self.tensors = tensors
        self.prefix = prefix
        self.metadata = metadata or {}
        self._names: list[str] | None = None  # built on first use: most rules only test single names
        self._stems: set[str] | None = None

    @property
    def _keys(self) -> list[str]:
        if self._names is None:
            self._names = [k for k in self.tensors if k.startswith(self.prefix)]
        return self._names

    def declared(self, section: str) -> dict[str, Any]:
        """What the file's ``config`` metadata declares under ``section`` (some writers state hyper-parameters
        that no tensor shows, such as Wan's causal variants); empty when absent or not JSON."""
        try:
            declared = json.loads(self.metadata.get("config", "{}")).get(section, {})
        except (ValueError, AttributeError):
            return {}
        return declared if isinstance(declared, dict) else {}

    def has(self, key: str) -> bool:
        """Whether ``prefix + key`` is a tensor of the file."""
        return self.prefix + key in self.tensors

    def has_all(self, keys: Iterable[str]) -> bool:
        """Whether every one of ``keys`` is present."""
        return all(self.has(k) for k in keys)

    def root_has(self, key: str) -> bool:
        """Whether ``key`` (not prefixed) is a tensor of the file."""
        return key in self.tensors

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of ``prefix + key`` (raises ``KeyError`` when absent)."""
        return self.tensors[self.prefix + key].shape

    def dim(self, key: str, index: int, default: int | None = None) -> int | None:
        """One dimension of ``prefix + key``, or ``default`` when the tensor is absent."""
        if not self.has(key):
            return default
        return self.shape(key)[index]

    def dtype(self, key: str) -> str | None:
        """The stored dtype of ``prefix + key``, or ``None``."""
        info = self.tensors.get(self.prefix + key)
        return info.dtype if info is not None else None

    def starts(self, stem: str) -> bool:
        """Whether any key starts with ``prefix + stem``."""
        full = self.prefix + stem
        return any(k.startswith(full) for k in self._keys)

    def count(self, pattern: str) -> int:
        """How many consecutive blocks ``pattern.format(0)``, ``pattern.format(1)``, ... exist.

        ``pattern`` names whole path segments (``"input_blocks.{}."``); a trailing dot is optional.
        """
        if self._stems is None:  # every dotted stem of every name, built once: detection stays fast
            self._stems = set()
            for key in self.keys():
                parts = key.split(".")
                self._stems.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        count = 0
        while pattern.format(count).rstrip(".") in self._stems:
            count += 1
        return count

    def keys(self) -> list[str]:
        """Names under the prefix, relative to it."""
        return [k[len(self.prefix) :] for k in self._keys]
