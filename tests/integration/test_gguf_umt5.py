"""A UMT5 GGUF text encoder (Wan's UMT5-XXL, ACE-Step's UMT5-Base) in Load Text Encoders With Device, in this
process, against ComfyUI's own Load CLIP given the same encoder as a safetensors file.

ComfyUI builds UMT5's tokenizer from a ``spiece_model`` blob in the safetensors file; llama.cpp's converter keeps
that tokenizer as GGUF metadata instead, and our loader rebuilds the blob from it (``core.detection.gguf_tokenizer``).
The encoder is a synthetic UMT5-Base (random weights of the real layout: the smallest UMT5 ComfyUI builds, as type
``ace``; UMT5-XXL is 5.7 billion parameters) with a unigram tokenizer trained here with T5's settings, stored F16 in
the GGUF so that both loaders compute from the same numbers; the embedding's rows past the tokenizer's pieces are
zeros, kept as holes in both files (no prompt reaches them; the two files would otherwise take 1.1 GB of disk).
What holds: both tokenize every prompt alike and as SentencePiece's own model does, and encode alike; a UMT5 GGUF
without a tokenizer is refused before a weight is read, saying why, and so is a UMT5-Base given as Stable Audio's
type (ComfyUI would build ACE-Step's encoder).
Wan's UMT5-XXL itself is loaded from a sparse file of its real layout, and its tokens checked (in one pass).
"""

from __future__ import annotations

import gc
import importlib

import gguf
import pytest
import sentencepiece
import torch

from tests.core.test_gguf_header import quantised_type, write_sparse_gguf
from tests.core.test_gguf_names import t5_weights
from tests.integration.test_gguf_loader import record_reads
from tests.passes import ONCE
from tools.fixtures.files import hollow
from tools.fixtures.gguf_files import UMT5_BASE, llama_cpp_name, write_gguf, write_t5_base
from tools.fixtures.gguf_tokenizers import PROMPTS, llama_cpp_tokenizer, train_unigram


@pytest.fixture(scope="module")
def comfy(comfy_runtime, module_folder):
    from tools.runtime.inprocess import import_comfy, import_pack

    mm = import_comfy()
    folder = module_folder
    proto = train_unigram()
    blob = {"spiece_model": torch.frombuffer(bytearray(proto), dtype=torch.uint8)}  # as ComfyUI's files hold it
    pieces = sentencepiece.SentencePieceProcessor(model_proto=proto).get_piece_size()  # the rows a prompt reaches
    source = write_t5_base(folder / "umt5_base_synthetic.safetensors", config=UMT5_BASE, extra=blob, live_rows=pieces)
    rename = llama_cpp_name(gguf.MODEL_ARCH.T5ENCODER, UMT5_BASE["layers"])
    tokenizer = llama_cpp_tokenizer(proto, vocabulary=UMT5_BASE["vocab"])
    encoder = hollow(write_gguf(source, folder / "umt5_base_F16.gguf", "F16", "t5encoder", rename, tokenizer))
    importlib.import_module("folder_paths").add_model_folder_path("text_encoders", str(folder))
    pack = import_pack()
    module = lambda name: importlib.import_module(f"{pack.__name__}.{name}")  # noqa: E731
    yield mm, module, encoder, source, proto
    mm.unload_all_models()
    gc.collect()


def _tokens(clip, prompt: str) -> list[int]:
    return [token for token, _weight in clip.tokenize(prompt)["umt5base"][0]]


def test_the_tokenizer_comes_back_from_the_gguf_and_the_encoder_encodes_as_comfyuis(comfy):
    mm, module, encoder, source, proto = comfy
    node = module("nodes.load_text_encoders").LoadTextEncodersWithDevice
    ours, summary = node.execute(encoder.name, "none", "none", "none", "ace", "cpu", "fp32").args
    comfy_sd = importlib.import_module("comfy.sd")
    options = {"dtype": torch.float32}
    theirs = comfy_sd.load_clip([str(source)], clip_type=comfy_sd.CLIPType.ACE, model_options=options)
    spiece = sentencepiece.SentencePieceProcessor(model_proto=proto)
    for prompt in PROMPTS[:-1]:  # ComfyUI pads an empty prompt its own way
        assert _tokens(ours, prompt) == _tokens(theirs, prompt) == [*spiece.encode(prompt), 1], prompt  # 1: </s>
    with torch.no_grad():
        got, expected = (clip.encode_from_tokens(clip.tokenize(PROMPTS[0])).float() for clip in (ours, theirs))
    assert torch.equal(got, expected)
    assert type(ours.cond_stage_model) is type(theirs.cond_stage_model)
    assert "UMT5-Base" in summary, summary
    del ours, theirs
    mm.unload_all_models()
    gc.collect()


def test_a_umt5_gguf_without_its_tokenizer_or_of_another_type_is_refused_before_a_weight_is_read(
    comfy, monkeypatch, tmp_path
):
    _mm, module, encoder, _source, _proto = comfy
    importlib.import_module("folder_paths").add_model_folder_path("text_encoders", str(tmp_path))
    read = record_reads(module, monkeypatch)
    error = module("core.errors").DeviceControlError
    node = module("nodes.load_text_encoders").LoadTextEncodersWithDevice
    weights = t5_weights("te_umt5xxl.json")  # the real layout, under llama.cpp's names
    rename = llama_cpp_name(gguf.MODEL_ARCH.T5ENCODER, 24)
    written = {rename(name): (shape, quantised_type(shape)) for name, shape in weights.items()}
    bare = write_sparse_gguf(written, tmp_path / "umt5_bare.gguf", "t5encoder")
    with pytest.raises(error, match=r"umt5_bare\.gguf is a GGUF UMT5-XXL without its tokenizer: ComfyUI builds"):
        node.execute(bare.name, "none", "none", "none", "wan", "cpu", "auto")
    with pytest.raises(error, match=r"umt5_base_F16\.gguf is UMT5-Base\)\. To fix it, choose the type ace"):
        node.execute(encoder.name, "none", "none", "none", "stable_audio", "cpu", "auto")  # would build ACE's
    assert read == []


@ONCE  # ComfyUI's Wan branch hands the blob to the tokenizer the same way in every version tested
def test_wans_umt5_xxl_gguf_tokenizes_with_the_tokenizer_it_carries(comfy, tmp_path):
    """Wan's type builds the full UMT5-XXL (5.7 billion parameters): a sparse file of the real layout (zero
    blocks, no disk used) carrying the tokenizer, loaded for real (3.2 GB of K blocks) but not encoded (a prompt
    padded to 512 tokens through it takes minutes on a CPU): the tokens are the tokenizer's own."""
    mm, module, _encoder, _source, proto = comfy
    importlib.import_module("folder_paths").add_model_folder_path("text_encoders", str(tmp_path))
    rename = llama_cpp_name(gguf.MODEL_ARCH.T5ENCODER, 24)
    written = {rename(name): (shape, quantised_type(shape)) for name, shape in t5_weights("te_umt5xxl.json").items()}
    tokenizer = llama_cpp_tokenizer(proto, vocabulary=UMT5_BASE["vocab"])
    path = write_sparse_gguf(written, tmp_path / "umt5_xxl.gguf", "t5encoder", tokenizer=tokenizer)
    node = module("nodes.load_text_encoders").LoadTextEncodersWithDevice
    clip, summary = node.execute(path.name, "none", "none", "none", "wan", "cpu", "auto").args
    expected = [*sentencepiece.SentencePieceProcessor(model_proto=proto).encode(PROMPTS[0]), 1]
    tokens = [token for token, _weight in clip.tokenize(PROMPTS[0])["umt5xxl"][0]]
    assert tokens[: len(expected)] == expected and set(tokens[len(expected) :]) <= {0}  # then padding
    assert "UMT5-XXL" in summary, summary
    del clip
    mm.unload_all_models()
    gc.collect()
