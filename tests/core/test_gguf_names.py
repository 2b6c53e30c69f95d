"""ComfyUI's names for a llama.cpp GGUF text encoder's tensors (``core.detection.gguf_names``), against the GGML
project's own tensor-name map (``gguf.get_tensor_name_map``, what its converters write), on the real T5-XXL and
UMT5-XXL layouts; and the header reader giving such a file ComfyUI's names, so detection names its encoder as it
names the safetensors file's."""

from __future__ import annotations

import gguf
import pytest

from core.detection.detect import detect
from core.detection.gguf_names import comfy_names
from core.detection.headers import read_header
from tests.core.test_gguf_header import quantised_type, write_sparse_gguf
from tools.fixtures.gguf_files import QWEN3_06B, T5_BASE, llama_cpp_name
from tools.fixtures.layouts import layouts

LAYOUTS = layouts()
#: Real layouts and what detection calls their encoder.
T5_LAYOUTS = {"te_t5xxl_fp16.json": "T5-XXL", "te_umt5xxl.json": "UMT5-XXL"}


def t5_weights(layout: str) -> dict[str, list[int]]:
    """The layout's weights: not ComfyUI's ``logit_scale`` nor UMT5's tokenizer blob (a GGUF carries neither)."""
    tensors = LAYOUTS[layout]["tensors"]
    return {name: shape for name, (shape, _dtype) in tensors.items() if name.endswith((".weight", ".bias"))}


def _blocks(names) -> int:
    return 1 + max(int(name.split(".")[2]) for name in names if name.startswith("encoder.block."))


@pytest.mark.parametrize("layout", list(T5_LAYOUTS))
def test_every_t5_name_the_converter_writes_maps_back_to_comfyuis(layout):
    names = list(t5_weights(layout))
    rename = llama_cpp_name(gguf.MODEL_ARCH.T5ENCODER, _blocks(names))
    written = {rename(name): name for name in names}
    assert len(written) == len(names)  # no two tensors share a llama.cpp name
    assert comfy_names("t5encoder", written) == written


def test_t5_base_without_a_gate_maps_its_up_projection_to_wi():
    block = "encoder.block.0.layer.1.DenseReluDense"
    names = [f"{block}.wi.weight", f"{block}.wo.weight", "shared.weight"]
    rename = llama_cpp_name(gguf.MODEL_ARCH.T5ENCODER, T5_BASE["layers"])
    assert comfy_names("t5encoder", {rename(n): n for n in names}) == {rename(n): n for n in names}


def _qwen3_names(layers: int) -> list[str]:
    """ComfyUI's names of a Qwen3 text encoder's tensors (as ``tools.fixtures.gguf_files.write_qwen3`` writes them)."""
    parts = [f"self_attn.{p}_proj" for p in "qkvo"] + ["self_attn.q_norm", "self_attn.k_norm", "input_layernorm"]
    parts += ["post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    layered = [f"model.layers.{i}.{part}.weight" for i in range(layers) for part in parts]
    return ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", *layered]


def test_every_qwen3_name_the_converter_writes_maps_back_to_comfyuis(tmp_path):
    names = _qwen3_names(QWEN3_06B["layers"])
    rename = llama_cpp_name(gguf.MODEL_ARCH.QWEN3, QWEN3_06B["layers"])
    written = {rename(name): name for name in names}
    assert len(written) == len(names) and comfy_names("qwen3", written) == written
    shapes = {
        name: ([64, 256] if name.endswith("proj.weight") else [256], gguf.GGMLQuantizationType.F32) for name in written
    }
    header = read_header(write_sparse_gguf(shapes, tmp_path / "qwen3.gguf", "qwen3"), gguf=True)
    assert set(header.tensors) == set(names)


def test_other_architectures_and_unknown_names_keep_their_names():
    assert comfy_names("llama", {"blk.0.attn_q.weight": None}) is None
    assert comfy_names("t5encoder", {"enc.blk.0.attn_q.weight": None, "dec.blk.0.attn_q.weight": None}) is None
    assert comfy_names("qwen3", {"blk.0.attn_q.weight": None, "blk.0.attn_qkv.weight": None}) is None


@pytest.mark.parametrize("layout", list(T5_LAYOUTS))
def test_a_llama_cpp_gguf_is_read_with_comfyuis_names_and_detected_as_its_safetensors(layout, tmp_path):
    tensors = t5_weights(layout)
    rename = llama_cpp_name(gguf.MODEL_ARCH.T5ENCODER, _blocks(tensors))
    written = {rename(name): (shape, quantised_type(shape)) for name, shape in tensors.items()}
    path = write_sparse_gguf(written, tmp_path / "encoder.gguf", "t5encoder")
    header = read_header(path, gguf=True)
    assert set(header.tensors) == set(tensors)
    assert all(info.name == name and list(info.shape) == tensors[name] for name, info in header.tensors.items())
    found = detect(path)
    assert (found.kind, found.family) == ("text_encoder", T5_LAYOUTS[layout])
