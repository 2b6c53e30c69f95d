"""GGUF copies of our synthetic diffusion models, quantised by the GGML project's own ``gguf`` package (the test
oracle, never a dependency of the pack): what the GGUF tests, the example workflow and the benchmark load.

A weight is quantised the way GGUF converters do it: a layer's weight matrix (two or more dimensions) whose rows are
whole blocks and that is not tiny takes the type asked for; vectors, small tensors and other tensors (a positional
table) stay F32. A tensor of more than four
dimensions (a video model's patch embedding) is stored flattened to two, with its shape recorded under
``comfy.gguf.orig_shape.<name>``, as ComfyUI's GGUF converters record it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open

from tools.fixture_files import hollow
from tools.gguf_tokenizers import add_tokenizer

#: The Flux-layout example's GGUF: the synthetic Flux.1 dev model quantised to Q8_0 (``make_all()`` key ``flux_gguf``).
FLUX_GGUF = "device_control_flux_dev_d1_Q8_0.gguf"
#: Tensors smaller than this stay F32 (converters keep small ones unquantised: they cost nothing).
SMALL = 1024
ORIG_SHAPE = "comfy.gguf.orig_shape."


def quantised_type(name: str, shape: tuple[int, ...], kind: str) -> gguf.GGMLQuantizationType:
    """The type a converter gives tensor ``name`` of ``shape`` when asked for ``kind`` (``Q8_0``, ``Q4_0``, ...)."""
    quant = gguf.GGMLQuantizationType[kind]
    values = gguf.GGML_QUANT_SIZES[quant][0]
    if not name.endswith(".weight") or len(shape) < 2 or int(np.prod(shape)) < SMALL or shape[-1] % values:
        return gguf.GGMLQuantizationType.F32
    return quant


def write_gguf(
    source: Path,
    target: Path,
    kind: str,
    architecture: str,
    rename: Callable[[str], str] = str,
    tokenizer: dict | None = None,
) -> Path:
    """``source`` (a safetensors model) as a GGUF file quantised to ``kind``, each tensor under ``rename(name)``
    (a text encoder's llama.cpp name: :func:`llama_cpp_name`), carrying ``tokenizer`` metadata where given
    (``tools.gguf_tokenizers``; a tokenizer blob in the source is left out, as the converter leaves it); made
    once, then reused."""
    if target.exists() and target.stat().st_mtime >= source.stat().st_mtime:
        return target
    partial = target.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), architecture)
    if tokenizer is not None:
        add_tokenizer(writer, tokenizer)
    with safe_open(str(source), framework="pt") as tensors:
        for name in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
            tensor = tensors.get_tensor(name)
            if tensor.is_floating_point():
                _add(writer, rename(name), tensor, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(target)
    return target


def _add(writer: gguf.GGUFWriter, name: str, tensor: torch.Tensor, kind: str) -> None:
    values = tensor.float().numpy()
    if values.ndim > 4:  # GGUF holds four dimensions at most
        writer.add_array(ORIG_SHAPE + name, list(values.shape))
        values = values.reshape(values.shape[0], -1)
    quant = quantised_type(name, values.shape, kind)
    if quant == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
        return
    writer.add_tensor(name, gguf.quants.quantize(values, quant), raw_dtype=quant)


def dequantised_twin(source: Path, target: Path, names: Mapping[str, str] | None = None) -> Path:
    """The GGUF ``source`` as a float32 safetensors file, every tensor as ``gguf`` dequantises it (the oracle's
    model: what the quantised model must compute), under ``names[name]`` where given (ComfyUI's names of a
    text encoder's llama.cpp ones)."""
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(str(source))
    shapes = {
        field.name.removeprefix(ORIG_SHAPE): [int(v) for v in field.contents()]
        for field in reader.fields.values()
        if field.name.startswith(ORIG_SHAPE)
    }
    out = {}
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        shape = shapes.get(tensor.name, [int(d) for d in reversed(tensor.shape)])
        name = (names or {}).get(tensor.name, tensor.name)
        out[name] = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)
    save_file(out, str(target))
    return target


def text_encoder_gguf(source: Path, folder: Path, architecture: gguf.MODEL_ARCH, layers: int) -> tuple[Path, Path]:
    """``source`` (a text encoder in ComfyUI's names) as a Q8_0 GGUF in ``folder`` under llama.cpp's names for
    ``architecture``, and its dequantised twin under ComfyUI's names (the oracle's model): both made once."""
    rename = llama_cpp_name(architecture, layers)
    stem = f"{source.stem.removesuffix('_synthetic')}_Q8_0"
    encoder = write_gguf(source, folder / f"{stem}.gguf", "Q8_0", gguf.MODEL_ARCH_NAMES[architecture], rename)
    with safe_open(str(source), framework="pt") as handle:
        names = {rename(name): name for name in handle.keys()}  # noqa: SIM118 - safe_open is not a mapping
    return encoder, dequantised_twin(encoder, folder / f"{stem}_dequantised.safetensors", names)


def llama_cpp_name(architecture: gguf.MODEL_ARCH, blocks: int) -> Callable[[str], str]:
    """The name llama.cpp's converter gives each tensor of a Hugging Face text encoder of ``architecture`` with
    ``blocks`` layers: ``gguf``'s own tensor-name map, what GGUF text encoders in the wild carry."""
    table = gguf.get_tensor_name_map(architecture, blocks)

    def rename(name: str) -> str:
        mapped = table.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise KeyError(f"gguf's {architecture.name} name map has no name for {name!r}")
        return mapped

    return rename


#: T5-Base as ComfyUI builds it (``comfy/text_encoders/t5_config_base.json``, Stable Audio's encoder): width,
#: feed-forward width, layers, heads, vocabulary and relative-position buckets; a plain feed-forward, one
#: relative-position table.
T5_BASE = {"d_model": 768, "d_ff": 3072, "layers": 12, "heads": 12, "vocab": 32128, "buckets": 32, "umt5": False}
#: UMT5-Base as ComfyUI builds it (``umt5_config_base.json``, ACE-Step's encoder): a gated feed-forward and a
#: relative-position table in every layer, UMT5's vocabulary.
UMT5_BASE = T5_BASE | {"d_ff": 2048, "vocab": 256384, "umt5": True}


def write_t5_base(
    target: Path, seed: int = 0, config: dict = T5_BASE, extra: dict | None = None, live_rows: int | None = None
) -> Path:
    """A synthetic T5-Base or UMT5-Base encoder (``config``; random weights of the real layout, ComfyUI's names)
    as float16 safetensors, with ``extra`` tensors beside (a tokenizer blob); made once, then reused. T5-Base is
    the smallest T5 a ComfyUI type takes (``stable_audio``), UMT5-Base the smallest UMT5 (``ace``). With
    ``live_rows``, the embedding's rows from there on (tokens the tokenizer never gives) are zeros, kept as holes
    in the file: UMT5's 256,384-row table then takes no disk beyond the rows a prompt can reach."""
    from safetensors.torch import save_file

    if target.exists():
        return target
    d, ff, heads = config["d_model"], config["d_ff"], config["heads"]
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * std).half()

    out = {"shared.weight": normal(config["vocab"], d, std=1.0)}
    out["shared.weight"][live_rows or config["vocab"] :] = 0
    out["encoder.final_layer_norm.weight"] = 1 + normal(d, std=0.1)
    feed_in = ("wi_0", "wi_1") if config["umt5"] else ("wi",)
    for i in range(config["layers"]):
        block = f"encoder.block.{i}.layer"
        out |= {f"{block}.0.SelfAttention.{p}.weight": normal(d, d, std=d**-0.5) for p in "qkvo"}
        out |= {f"{block}.{n}.layer_norm.weight": 1 + normal(d, std=0.1) for n in (0, 1)}
        out |= {f"{block}.1.DenseReluDense.{w}.weight": normal(ff, d, std=d**-0.5) for w in feed_in}
        out[f"{block}.1.DenseReluDense.wo.weight"] = normal(d, ff, std=ff**-0.5)
        if i == 0 or config["umt5"]:
            bias = f"{block}.0.SelfAttention.relative_attention_bias.weight"
            out[bias] = normal(config["buckets"], heads, std=1.0)
    partial = target.with_suffix(".partial")
    save_file(out | (extra or {}), str(partial))
    partial.replace(target)
    return hollow(target) if live_rows else target


#: Qwen3-0.6B as ComfyUI builds it (``comfy.text_encoders.llama.Qwen3_06BConfig``, Anima's encoder, the smallest
#: Qwen3 ComfyUI builds): width, feed-forward width, layers, query and key-value heads, head width, vocabulary.
QWEN3_06B = {"d_model": 1024, "d_ff": 3072, "layers": 28, "heads": 16, "kv_heads": 8, "head": 128, "vocab": 151936}


def write_qwen3(target: Path, seed: int = 0, config: dict = QWEN3_06B) -> Path:
    """A synthetic Qwen3 text encoder (random weights of the real layout, ComfyUI's names) as float16
    safetensors; made once, then reused."""
    from safetensors.torch import save_file

    if target.exists():
        return target
    d, ff, head = config["d_model"], config["d_ff"], config["head"]
    q, kv = config["heads"] * head, config["kv_heads"] * head
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * std).half()

    out = {
        "model.embed_tokens.weight": normal(config["vocab"], d, std=1.0),
        "model.norm.weight": 1 + normal(d, std=0.1),
    }
    for i in range(config["layers"]):
        layer = f"model.layers.{i}"
        shapes = {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q)}
        out |= {f"{layer}.self_attn.{p}.weight": normal(*shape, std=shape[1] ** -0.5) for p, shape in shapes.items()}
        out |= {f"{layer}.self_attn.{n}.weight": 1 + normal(head, std=0.1) for n in ("q_norm", "k_norm")}
        out |= {f"{layer}.{n}.weight": 1 + normal(d, std=0.1) for n in ("input_layernorm", "post_attention_layernorm")}
        out |= {f"{layer}.mlp.{p}.weight": normal(ff, d, std=d**-0.5) for p in ("gate_proj", "up_proj")}
        out[f"{layer}.mlp.down_proj.weight"] = normal(d, ff, std=ff**-0.5)
    partial = target.with_suffix(".partial")
    save_file(out, str(partial))
    partial.replace(target)
    return target
