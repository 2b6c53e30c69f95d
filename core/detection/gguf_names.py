"""ComfyUI's names for a GGUF text encoder's tensors, which the GGML project's converters name their own way.

A T5 encoder converted by llama.cpp (architecture ``t5encoder``: the T5-XXL of Flux, SD3 and Chroma, T5-Base, and
the UMT5 of Wan and ACE-Step, whose tokenizer comes back from the file's metadata: :mod:`.gguf_tokenizer`) calls
its token table ``token_embd`` and its layers ``enc.blk.N.attn_q`` and so on,
where ComfyUI's loaders (and the safetensors files of the same models) say ``shared`` and
``encoder.block.N.layer.0.SelfAttention.q``.
The header reader renames such a file's tensor table once (:func:`comfy_names`): detection, the fit plan, ComfyUI's
own choice of encoder class and the fill then see a GGUF text encoder as they see its safetensors file, while each
tensor's bytes stay where the file has them. The T5 conversion changes no tensor's layout, only its name.

A Qwen3 encoder (architecture ``qwen3``: Z-Image's and Flux.2 Klein's Qwen3-4B, Klein 9B's Qwen3-8B, Anima's
Qwen3-0.6B) calls its layers ``blk.N.attn_q`` and so on where ComfyUI says ``model.layers.N.self_attn.q_proj``; its
converter reorders nothing either (it permutes the query and key rows of Llama models only), and ComfyUI ships the
Qwen tokenizer, so the names are all there is to map.

Architectures not listed here (llama.cpp's Llama, Qwen2-VL and Gemma encoders) keep their names; the loaders refuse
them, saying so. The names are checked against the ``gguf`` package's own tensor-name map in the tests.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

#: What a T5 block's tensors are called by llama.cpp, and by ComfyUI (under ``encoder.block.N.``).
_T5_BLOCK = {
    "attn_q": "layer.0.SelfAttention.q",
    "attn_k": "layer.0.SelfAttention.k",
    "attn_v": "layer.0.SelfAttention.v",
    "attn_o": "layer.0.SelfAttention.o",
    "attn_rel_b": "layer.0.SelfAttention.relative_attention_bias",
    "attn_norm": "layer.0.layer_norm",
    "ffn_norm": "layer.1.layer_norm",
    "ffn_gate": "layer.1.DenseReluDense.wi_0",
    "ffn_down": "layer.1.DenseReluDense.wo",
}
#: The T5 tensors outside the blocks.
_T5_TOP = {"token_embd": "shared", "enc.output_norm": "encoder.final_layer_norm"}
_T5_BLOCK_NAME = re.compile(r"enc\.blk\.(\d+)\.([a-z_]+)\.(weight|bias)")

#: What a Qwen3 layer's tensors are called by llama.cpp, and by ComfyUI (under ``model.layers.N.``).
_QWEN3_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
#: The Qwen3 tensors outside the layers (``output``: a language-model head, which ComfyUI leaves unused).
_QWEN3_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")

#: The architectures (``general.architecture``) whose names are mapped.
MAPPED_ARCHITECTURES = ("t5encoder", "qwen3")


def comfy_names(architecture: str | None, names: Mapping[str, object]) -> dict[str, str] | None:
    """ComfyUI's name for each of ``names`` (a GGUF file's tensor names), or ``None`` when the file is not one of
    :data:`MAPPED_ARCHITECTURES` or a name is not one its converter writes (the file keeps its names then)."""
    if architecture == "t5encoder":
        gated = any(".ffn_gate." in name for name in names)
        renamed = {name: _t5_name(name, gated) for name in names}
    elif architecture == "qwen3":
        renamed = {name: _qwen3_name(name) for name in names}
    else:
        return None
    return None if None in renamed.values() else renamed  # type: ignore[return-value]


def _qwen3_name(name: str) -> str | None:
    """ComfyUI's name for one llama.cpp Qwen3 tensor."""
    stem, _, suffix = name.rpartition(".")
    if stem in _QWEN3_TOP:
        return f"{_QWEN3_TOP[stem]}.{suffix}"
    match = _BLOCK_NAME.fullmatch(name)
    if match is None or match.group(2) not in _QWEN3_BLOCK:
        return None
    block, part, suffix = match.groups()
    return f"model.layers.{block}.{_QWEN3_BLOCK[part]}.{suffix}"


def _t5_name(name: str, gated: bool) -> str | None:
    """ComfyUI's name for one llama.cpp T5 encoder tensor (``ffn_up`` is ``wi_1`` beside a gate, else ``wi``)."""
    stem, _, suffix = name.rpartition(".")
    if stem in _T5_TOP:
        return f"{_T5_TOP[stem]}.{suffix}"
    match = _T5_BLOCK_NAME.fullmatch(name)
    if match is None:
        return None
    block, part, suffix = match.groups()
    if part == "ffn_up":
        inner = "layer.1.DenseReluDense.wi_1" if gated else "layer.1.DenseReluDense.wi"
    elif part in _T5_BLOCK:
        inner = _T5_BLOCK[part]
    else:
        return None
    return f"encoder.block.{block}.{inner}.{suffix}"
