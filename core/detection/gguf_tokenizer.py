"""The SentencePiece tokenizer a GGUF text encoder carries in its metadata, rebuilt as the model file ComfyUI reads.

ComfyUI builds UMT5's tokenizer (Wan's UMT5-XXL, ACE-Step's UMT5-Base) from a ``spiece_model`` tensor in the
encoder's safetensors file: a serialised SentencePiece ``ModelProto``. llama.cpp's converter does not keep that
file; it writes what the tokenizer is made of as GGUF metadata (``tokenizer.ggml.model`` = ``t5``: a unigram
model): every piece with its score and type, whether a space is prefixed and runs of spaces collapsed, the
normaliser's precompiled character map, and the special tokens' ids. Those are all a unigram SentencePiece model
needs to encode, so the ``ModelProto`` is written back from them here (protobuf's wire format by hand: three
messages of scalars and strings, not worth a dependency). Pieces the converter padded the vocabulary with
(``[PAD1]`` ..., type unused) and the Hugging Face tokenizer's added tokens it wrote as user-defined (T5's
``<extra_id_N>``) come back as unused pieces, which SentencePiece never emits, as the original model has no such
pieces; the other ids are the original model's, so a prompt encodes to the same ids (the tests compare with
SentencePiece's own model).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .gguf_header import read_gguf_metadata
from .tensor_info import FileHeader

#: What llama.cpp calls a SentencePiece unigram tokenizer (T5, UMT5) in ``tokenizer.ggml.model``.
UNIGRAM_MODEL = "t5"
#: The UMT5 vocabulary size: an encoder with this many token embeddings is one ComfyUI reads a tokenizer for.
UMT5_VOCABULARY = 256384
#: The tensor name ComfyUI reads UMT5's tokenizer from.
SPIECE_MODEL = "spiece_model"
_KEY = "tokenizer.ggml."
#: GGUF token types (llama.cpp's) are SentencePiece's piece types by number: 1 normal ... 6 byte.
_USER_DEFINED, _UNUSED, _BYTE = 4, 5, 6
#: The score llama.cpp's converter gives the Hugging Face tokenizer's added tokens (T5's ``<extra_id_N>``), which it
#: marks user-defined: SentencePiece would match them whole, where the model file ComfyUI reads has no such piece.
_ADDED_SCORE = -1000.0
#: The special tokens: GGUF's id key, SentencePiece's trainer-spec field numbers (id, piece).
_SPECIALS = {
    "unknown_token_id": (40, 45),
    "bos_token_id": (41, 46),
    "eos_token_id": (42, 47),
    "padding_token_id": (43, 48),
}
#: TrainerSpec fields: model type (1 = unigram), vocabulary size, byte fallback.
_MODEL_TYPE, _VOCAB_SIZE, _BYTE_FALLBACK, _UNIGRAM = 3, 4, 35, 1
#: NormalizerSpec fields: name, precompiled character map, dummy prefix, extra whitespace removal, escaping.
_NAME, _CHARSMAP, _PREFIX, _WHITESPACE, _ESCAPE = 1, 2, 3, 4, 5


def carries_unigram_tokenizer(metadata: Mapping[str, Any]) -> bool:
    """Whether a GGUF's metadata (scalars at least) says it carries a SentencePiece unigram tokenizer."""
    return metadata.get(f"{_KEY}model") == UNIGRAM_MODEL


def tokenizer_from_weights(header: FileHeader) -> bool:
    """Whether ComfyUI builds this text encoder's tokenizer from its weights file: a UMT5 (XXL or Base), told by
    its token table (under ComfyUI's names, as the header reader gives a llama.cpp T5's)."""
    table = header.tensors.get("shared.weight")
    return table is not None and table.shape[0] == UMT5_VOCABULARY


def sentencepiece_model(metadata: Mapping[str, Any]) -> bytes | None:
    """The serialised SentencePiece ``ModelProto`` of the unigram tokenizer in a GGUF's ``metadata`` (arrays
    included), or ``None`` when it carries none (or its piece lists disagree in length)."""
    tokens, scores, types = (metadata.get(f"{_KEY}{key}") for key in ("tokens", "scores", "token_type"))
    if not carries_unigram_tokenizer(metadata) or not isinstance(tokens, list) or not tokens:
        return None
    scores = scores if isinstance(scores, list) else [0.0] * len(tokens)
    types = types if isinstance(types, list) else [1] * len(tokens)
    if not len(tokens) == len(scores) == len(types):
        return None
    pieces = b"".join(_message(1, _piece(*entry)) for entry in zip(tokens, scores, types, strict=True))
    return pieces + _message(2, _trainer_spec(metadata, tokens, types)) + _message(3, _normalizer_spec(metadata))


def read_tokenizer(path: str | Path) -> bytes | None:
    """The SentencePiece model carried by the GGUF file at ``path`` (see :func:`sentencepiece_model`).

    Raises:
        ModelFileError: the file's header is broken.
    """
    return sentencepiece_model(read_gguf_metadata(Path(path)))


def _piece(token: str, score: float, kind: int) -> bytes:
    if kind == _USER_DEFINED and score == _ADDED_SCORE:  # a Hugging Face added token: not in the original model
        kind = _UNUSED
    return _string(1, token.encode("utf-8")) + _tag(2, 5) + struct.pack("<f", score) + _number(3, kind)


def _trainer_spec(metadata: Mapping[str, Any], tokens: list[str], types: Iterable[int]) -> bytes:
    out = _number(_MODEL_TYPE, _UNIGRAM) + _number(_VOCAB_SIZE, len(tokens))
    out += _number(_BYTE_FALLBACK, int(_BYTE in types))
    for key, (id_field, piece_field) in _SPECIALS.items():
        token_id = metadata.get(f"{_KEY}{key}", -1)
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            out += _number(id_field, token_id) + _string(piece_field, tokens[token_id].encode("utf-8"))
        else:
            out += _number(id_field, -1)  # absent: T5 has no beginning-of-sequence token
    return out


def _normalizer_spec(metadata: Mapping[str, Any]) -> bytes:
    charsmap = metadata.get(f"{_KEY}precompiled_charsmap") or []
    out = _string(_NAME, b"nmt_nfkc" if charsmap else b"identity")
    out += _string(_CHARSMAP, bytes(value & 0xFF for value in charsmap))  # int8 or uint8 elements
    out += _number(_PREFIX, int(bool(metadata.get(f"{_KEY}add_space_prefix", True))))
    out += _number(_WHITESPACE, int(bool(metadata.get(f"{_KEY}remove_extra_whitespaces", True))))
    return out + _number(_ESCAPE, 1)


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative numbers as protobuf writes them: ten bytes of two's complement
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _tag(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _number(field: int, value: int) -> bytes:
    return _tag(field, 0) + _varint(value)


def _string(field: int, value: bytes) -> bytes:
    return _tag(field, 2) + _varint(len(value)) + value


def _message(field: int, body: bytes) -> bytes:
    return _string(field, body)
