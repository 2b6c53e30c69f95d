"""SentencePiece tokenizers for the GGUF text-encoder tests: a small unigram model trained here with T5's
settings, and the GGUF metadata llama.cpp's converter writes for such a model.

The model is trained by SentencePiece itself (nothing downloaded) on sentences made from a fixed word list, with
T5's special ids (pad 0, end of sequence 1, unknown 2, no beginning token) and its NFKC normaliser, so the
precompiled character map, the dummy prefix and whitespace handling all take part. :func:`llama_cpp_tokenizer`
writes the metadata the way the converter does for T5 and UMT5 (``tokenizer.ggml.model`` = ``t5``; the piece
list, scores and types from SentencePiece's own accessors; the normaliser's flags and character map from the
model file; the special ids), padding the vocabulary with unused ``[PADn]`` pieces to the model's embedding count
as the converter does for UMT5.
"""

from __future__ import annotations

import io
import itertools
import random
from typing import Any

import sentencepiece


def _wide(text: str) -> str:
    """``text`` in full-width letters (which NFKC folds back to ASCII)."""
    return "".join(chr(ord(c) + 0xFEE0) if c.isascii() and c.isalpha() else c for c in text)


#: Words the training sentences are made of: Latin, accented, full-width and CJK characters, digits, punctuation.
_WORDS = [
    word
    for line in (
        "a red fox in fresh snow photographed at dawn the quick brown dog jumps over lazy river mountain",
        "city night neon light rain street portrait of an old man with a beard",
        "café naïve façade résumé über straße 2024 3.14 100% — (brackets) [square] {curly}",
        "\u65e5\u672c \u6771\u4eac \u732b \u72ac \u96ea \ufb01ne \ufb02ower \u216b \u00bd",
        _wide("Fullwidth fox"),
    )
    for word in line.split()
]
#: Prompts compared between the original model and the one rebuilt from GGUF metadata.
PROMPTS = (
    "a red fox in fresh snow, photographed at dawn",
    "  leading and   repeated   spaces  ",
    f"{_wide('Fullwidth fox')} and \ufb01ne \ufb02owers at \u00bd past \u216b",  # NFKC folds all of these
    "\u65e5\u672c\u306e\u6771\u4eac\u3067\u732b\u3068\u72ac\u304c\u96ea\u306e\u4e2d\u306b\u3044\u308b",
    "unseen characters: \u2603 \U0001f98a \u222e \u05e7",
    "<extra_id_0> marks a span",  # an added token of T5's Hugging Face tokenizer, not of its model
    "café naïve façade résumé über straße 2024 3.14 100%",
    "",
)
#: T5's special ids (``pad``, ``</s>``, ``<unk>``; no ``<s>``).
T5_SPECIALS = {"pad_id": 0, "eos_id": 1, "unk_id": 2, "bos_id": -1}
_TYPES = {"is_unknown": 2, "is_control": 3, "is_unused": 5, "is_byte": 6}


def train_unigram(vocab_size: int = 200, byte_fallback: bool = False, **options: Any) -> bytes:
    """A unigram SentencePiece model trained on sentences of :data:`_WORDS` with T5's settings (its proto);
    ``options`` are SentencePiece's own (other special pieces' names, no dummy prefix ...)."""
    choose = random.Random(0).choice
    sentences = [" ".join(choose(_WORDS) for _ in range(12)) for _ in range(600)]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model,
        model_type="unigram",
        vocab_size=vocab_size,
        hard_vocab_limit=False,  # as many pieces as the sentences give, up to the size asked
        character_coverage=0.98,  # the rarest characters stay unknown, as in a real vocabulary
        byte_fallback=byte_fallback,
        minloglevel=2,
        **(T5_SPECIALS | options),
    )
    return model.getvalue()


def llama_cpp_tokenizer(proto: bytes, vocabulary: int | None = None, added: tuple[str, ...] = ()) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` metadata llama.cpp's converter writes for the unigram model ``proto``: the
    Hugging Face tokenizer's ``added`` tokens after its pieces (user-defined, score -1000), then unused ``[PADn]``
    pieces up to ``vocabulary`` entries where that is larger."""
    processor = sentencepiece.SentencePieceProcessor(model_proto=proto)
    size = processor.get_piece_size()
    tokens = [processor.id_to_piece(i) for i in range(size)]
    scores = [processor.get_score(i) for i in range(size)]
    types = [next((t for test, t in _TYPES.items() if getattr(processor, test)(i)), 1) for i in range(size)]
    tokens, scores, types = tokens + list(added), scores + [-1000.0] * len(added), types + [4] * len(added)
    size += len(added)
    padding = range(1, max(0, (vocabulary or size) - size) + 1)
    normalizer = dict(_fields(dict(_fields(proto))[3]))
    metadata: dict[str, Any] = {
        "tokenizer.ggml.model": "t5",
        "tokenizer.ggml.tokens": tokens + [f"[PAD{i}]" for i in padding],
        "tokenizer.ggml.scores": scores + [-1000.0 for _ in padding],
        "tokenizer.ggml.token_type": types + [5 for _ in padding],
        "tokenizer.ggml.add_space_prefix": bool(normalizer.get(3, 1)),
        "tokenizer.ggml.remove_extra_whitespaces": bool(normalizer.get(4, 1)),
        "tokenizer.ggml.precompiled_charsmap": normalizer.get(2, b""),
    }
    specials = {"unk_id": "unknown", "eos_id": "eos", "pad_id": "padding", "bos_id": "bos"}
    for method, key in specials.items():
        if (token_id := getattr(processor, method)()) >= 0:
            metadata[f"tokenizer.ggml.{key}_token_id"] = token_id
    return metadata


def add_tokenizer(writer: Any, metadata: dict[str, Any]) -> None:
    """Write ``metadata`` (from :func:`llama_cpp_tokenizer`) with ``gguf``'s writer, as the converter does."""
    writer.add_tokenizer_model(metadata["tokenizer.ggml.model"])
    writer.add_token_list(metadata["tokenizer.ggml.tokens"])
    writer.add_token_scores(metadata["tokenizer.ggml.scores"])
    writer.add_token_types(metadata["tokenizer.ggml.token_type"])
    writer.add_add_space_prefix(metadata["tokenizer.ggml.add_space_prefix"])
    writer.add_remove_extra_whitespaces(metadata["tokenizer.ggml.remove_extra_whitespaces"])
    if metadata["tokenizer.ggml.precompiled_charsmap"]:
        writer.add_precompiled_charsmap(metadata["tokenizer.ggml.precompiled_charsmap"])
    for key in ("unknown", "eos", "padding", "bos"):
        if (token_id := metadata.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            writer.add_uint32(f"tokenizer.ggml.{key}_token_id", token_id)


def _fields(message: bytes) -> list[tuple[int, Any]]:
    """The (field, value) pairs of a protobuf message: varints as ints, strings and messages as bytes."""
    out, at = [], 0
    while at < len(message):
        key, at = _varint(message, at)
        wire = key & 7
        if wire == 0:
            value, at = _varint(message, at)
        elif wire == 2:
            length, at = _varint(message, at)
            value, at = message[at : at + length], at + length
        else:  # fixed 32 or 64 bits
            width = 4 if wire == 5 else 8
            value, at = message[at : at + width], at + width
        out.append((key >> 3, value))
    return out


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = 0
    for shift in itertools.count(0, 7):
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
    raise AssertionError("unreachable")
