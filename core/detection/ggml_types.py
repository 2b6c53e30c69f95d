"""The GGML tensor types a GGUF file may store that Device Control reads: their names, numbers and block sizes.

A quantised type holds ``values`` numbers in blocks of ``size`` bytes (``Q4_K``: 256 in 144); the plain types are
blocks of one value. Detection counts a GGUF model's bytes with this table; ``core.weights.ggml_blocks`` decodes
the same types (a test keeps the two lists equal).

A quantised file mixes types: llama.cpp's quantiser gives a ``Q4_K_M`` file ``Q4_K`` blocks, ``Q6_K`` ones for
some layers (attention values, feed-forward outputs) and keeps norms, biases and tables plain, and names the mix
in ``general.file_type`` (llama.cpp's ``llama_ftype`` numbers). :func:`storage_label` names such a model by all of
it, not by the type that happens to hold the most bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
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


#: The plain (unquantised) types, and the torch dtypes a loader may turn them into, by the name a label gives them.
PLAIN_NAMES = {"F32": "F32", "F16": "F16", "BF16": "BF16", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}
#: llama.cpp's file types (``general.file_type``, ``llama_ftype``) by number; 1024 marks one the converter guessed.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS",
    20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M",
    28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
}  # fmt: skip
_GUESSED = 1024


def file_type_name(metadata: Mapping[str, object]) -> str | None:
    """The file type a GGUF's metadata names (``Q4_K_M``), or ``None`` where it names none or an unknown one."""
    value = metadata.get("general.file_type")
    try:
        number = int(str(value))
    except ValueError:
        return None
    return FILE_TYPES.get(number & ~_GUESSED)


def storage_label(sizes: Mapping[str, int], file_type: str | None = None) -> str | None:
    """How a GGUF model is stored, from its bytes by storage (GGML type names, or torch dtype names for the tensors a
    loader keeps plain): ``Q4_K_M: Q4_K/Q6_K blocks, F32 plain`` (the file type where known, the block types by
    their share of the bytes, then the plain types), or just ``Q8_0`` where one block type is all the file type
    says. ``None`` where no weight is in quantised blocks: the model is named as any other then."""
    ranked = [name for name, _ in sorted(sizes.items(), key=lambda item: -item[1])]
    blocks = [name for name in ranked if _in_blocks(name)]
    if not blocks:
        return None
    if len(blocks) == 1 and file_type in (None, blocks[0]):
        return blocks[0]
    label = f"{file_type}: " if file_type else ""
    return label + f"{'/'.join(blocks)} blocks" + _plain_part([name for name in ranked if name not in blocks])


def _plain_part(ranked: list[str]) -> str:
    """``, BF16/F32 plain`` for the plain storages ``ranked`` (torch's names given GGML's), or nothing."""
    plain = "/".join(dict.fromkeys(PLAIN_NAMES.get(name, name) for name in ranked))
    return f", {plain} plain" if plain else ""


def _in_blocks(name: str) -> bool:
    """Whether storage ``name`` is a quantised GGML type (``GGML type N``: one Device Control does not read)."""
    return name not in PLAIN_NAMES and (name in GGML_TYPES or name.startswith("GGML type"))
