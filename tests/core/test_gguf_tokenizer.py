"""The SentencePiece model rebuilt from a GGUF text encoder's tokenizer metadata (``core.detection.gguf_tokenizer``),
against SentencePiece itself: a unigram model trained with T5's settings, written into a GGUF as llama.cpp's
converter writes it (padded to a larger vocabulary, as UMT5's is), read back by our header reader and rebuilt, must
encode every prompt to the ids the original model gives (an added token of the Hugging Face tokenizer in a prompt
too); with and without byte fallback, with T5's special pieces and with others of other names and no dummy prefix."""

from __future__ import annotations

import pytest
import sentencepiece

from core.detection.gguf_tokenizer import read_tokenizer, sentencepiece_model
from core.detection.headers import read_header
from tests.core.test_gguf_header import write_sparse_gguf
from tools.fixtures.gguf_tokenizers import PROMPTS, llama_cpp_tokenizer, train_unigram

#: Tokenizers: a small vocabulary (rare characters unknown), one with byte fallback (none unknown), and one with
#: special pieces of its own names at other ids and no dummy prefix (what the rebuilt model must carry over, not
#: SentencePiece's defaults).
MODELS = {
    "unknowns": (200, False, {}),
    "byte_fallback": (600, True, {}),
    "own_specials": (
        200,
        False,
        {
            "unk_id": 1,
            "eos_id": 0,
            "pad_id": 2,
            "unk_piece": "<unknown>",
            "eos_piece": "<end>",
            "pad_piece": "<padding>",
            "add_dummy_prefix": False,
        },
    ),
}
#: What llama.cpp's converter adds after the model's pieces for T5 (its Hugging Face tokenizer's extra ids).
ADDED = ("<extra_id_0>", "<extra_id_1>")


@pytest.fixture(scope="module", params=list(MODELS))
def original(request) -> bytes:
    size, byte_fallback, options = MODELS[request.param]
    return train_unigram(size, byte_fallback=byte_fallback, **options)


def _processor(proto: bytes) -> sentencepiece.SentencePieceProcessor:
    return sentencepiece.SentencePieceProcessor(model_proto=proto)


def test_the_rebuilt_model_encodes_every_prompt_as_the_original(original, tmp_path):
    metadata = llama_cpp_tokenizer(original, vocabulary=1000, added=ADDED)  # padded, as UMT5's is
    path = write_sparse_gguf({}, tmp_path / "encoder.gguf", "t5encoder", tokenizer=metadata)
    assert read_header(path, gguf=True).metadata["tokenizer.ggml.model"] == "t5"
    rebuilt, expected = _processor(read_tokenizer(path)), _processor(original)
    assert rebuilt.get_piece_size() == 1000
    for prompt in PROMPTS:
        assert rebuilt.encode(prompt) == expected.encode(prompt), prompt
    specials = ("unk_id", "eos_id", "pad_id", "bos_id")
    assert [getattr(rebuilt, s)() for s in specials] == [getattr(expected, s)() for s in specials]
    assert [rebuilt.id_to_piece(getattr(rebuilt, s)()) for s in specials[:3]] == [
        expected.id_to_piece(getattr(expected, s)()) for s in specials[:3]
    ]


def test_the_normaliser_map_and_flags_take_part(original):
    metadata = llama_cpp_tokenizer(original)
    expected = _processor(original)
    without_map = _processor(sentencepiece_model(metadata | {"tokenizer.ggml.precompiled_charsmap": []}))
    assert without_map.encode(PROMPTS[2]) != expected.encode(PROMPTS[2])  # full-width letters, ligatures
    kept_spaces = _processor(sentencepiece_model(metadata | {"tokenizer.ggml.remove_extra_whitespaces": False}))
    assert kept_spaces.encode(PROMPTS[1]) != expected.encode(PROMPTS[1])


def test_a_file_without_a_unigram_tokenizer_gives_none(original, tmp_path):
    metadata = llama_cpp_tokenizer(original)
    assert sentencepiece_model(metadata | {"tokenizer.ggml.model": "llama"}) is None
    assert sentencepiece_model(metadata | {"tokenizer.ggml.scores": [0.0]}) is None  # lists disagree
    assert read_tokenizer(write_sparse_gguf({}, tmp_path / "none.gguf", "t5encoder")) is None
