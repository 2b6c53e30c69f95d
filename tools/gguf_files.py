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


def write_gguf(source: Path, target: Path, kind: str, architecture: str, rename: Callable[[str], str] = str) -> Path:
    """``source`` (a safetensors model) as a GGUF file quantised to ``kind``, each tensor under ``rename(name)``
    (a text encoder's llama.cpp name: :func:`llama_cpp_name`); made once, then reused."""
    if target.exists() and target.stat().st_mtime >= source.stat().st_mtime:
        return target
    partial = target.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), architecture)
    with safe_open(str(source), framework="pt") as tensors:
        for name in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
            _add(writer, rename(name), tensors.get_tensor(name), kind)
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
#: feed-forward width, layers, heads, vocabulary and relative-position buckets.
T5_BASE = {"d_model": 768, "d_ff": 3072, "layers": 12, "heads": 12, "vocab": 32128, "buckets": 32}


def write_t5_base(target: Path, seed: int = 0) -> Path:
    """A synthetic T5-Base encoder (random weights of the real layout, ComfyUI's names) as float16 safetensors:
    the smallest T5 a ComfyUI text-encoder type takes (``stable_audio``); made once, then reused."""
    from safetensors.torch import save_file

    if target.exists():
        return target
    d, ff, heads = T5_BASE["d_model"], T5_BASE["d_ff"], T5_BASE["heads"]
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * std).half()

    out = {"shared.weight": normal(T5_BASE["vocab"], d, std=1.0)}
    out["encoder.final_layer_norm.weight"] = 1 + normal(d, std=0.1)
    for i in range(T5_BASE["layers"]):
        block = f"encoder.block.{i}.layer"
        out |= {f"{block}.0.SelfAttention.{p}.weight": normal(d, d, std=d**-0.5) for p in "qkvo"}
        out |= {f"{block}.{n}.layer_norm.weight": 1 + normal(d, std=0.1) for n in (0, 1)}
        out[f"{block}.1.DenseReluDense.wi.weight"] = normal(ff, d, std=d**-0.5)
        out[f"{block}.1.DenseReluDense.wo.weight"] = normal(d, ff, std=ff**-0.5)
    bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    out[bias] = normal(T5_BASE["buckets"], heads, std=1.0)
    partial = target.with_suffix(".partial")
    save_file(out, str(partial))
    partial.replace(target)
    return target
