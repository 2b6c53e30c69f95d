"""The GGML tensor types a GGUF file may store that Device Control reads: their names, numbers and block sizes.

A quantised type holds ``values`` numbers in blocks of ``size`` bytes (``Q4_K``: 256 in 144); the plain types are
blocks of one value. Detection counts a GGUF model's bytes with this table; ``core.weights.ggml_blocks`` decodes
the same types (a test keeps the two lists equal).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ModelFileError


@dataclass(frozen=True)
class GgmlType:
    """One GGML tensor type: its name and number in GGUF, ``values`` per block in ``size`` bytes."""

    name: str
    ggml_id: int
    values: int
    size: int

    def nbytes(self, count: int) -> int:
        """The bytes ``count`` values take (``count`` a multiple of :attr:`values`)."""
        return count // self.values * self.size


#: The types read, by name; the numbers are GGML's ``ggml_type``.
GGML_TYPES: dict[str, GgmlType] = {
    t.name: t
    for t in (
        GgmlType("F32", 0, 1, 4),
        GgmlType("F16", 1, 1, 2),
        GgmlType("Q4_0", 2, 32, 18),
        GgmlType("Q4_1", 3, 32, 20),
        GgmlType("Q5_0", 6, 32, 22),
        GgmlType("Q5_1", 7, 32, 24),
        GgmlType("Q8_0", 8, 32, 34),
        GgmlType("Q2_K", 10, 256, 84),
        GgmlType("Q3_K", 11, 256, 110),
        GgmlType("Q4_K", 12, 256, 144),
        GgmlType("Q5_K", 13, 256, 176),
        GgmlType("Q6_K", 14, 256, 210),
        GgmlType("BF16", 30, 1, 2),
    )
}
_BY_ID = {t.ggml_id: t for t in GGML_TYPES.values()}


def ggml_type(ggml_id: int, tensor: str = "a tensor") -> GgmlType:
    """The type of GGUF type number ``ggml_id``.

    Raises:
        ModelFileError: a type Device Control does not read (an ``IQ`` or ternary type, say), named with those it does.
    """
    found = _BY_ID.get(ggml_id)
    if found is None:
        raise ModelFileError(
            f"{tensor} is stored in GGML type {ggml_id}, which Device Control does not dequantise (it reads "
            f"{', '.join(GGML_TYPES)}); requantise the model to one of those, or load it with a GGUF loader that "
            "reads that type."
        )
    return found
