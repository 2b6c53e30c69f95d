"""GGUF copies of our synthetic diffusion models, quantised by the GGML project's own ``gguf`` package (the test
oracle, never a dependency of the pack): what the GGUF tests, the example workflow and the benchmark load.

A weight is quantised the way GGUF converters do it: a layer's weight matrix (two or more dimensions) whose rows are
whole blocks and that is not tiny takes the type asked for; vectors, small tensors and other tensors (a positional
table) stay F32. A tensor of more than four dimensions (a video model's patch embedding) is kept whole in F32 with
all its dimensions, as ComfyUI-GGUF's ``tools/fix_5d_tensors.py`` puts it back into a quantised file.

:func:`write_comfyui_gguf` follows ComfyUI-GGUF's own three steps for a Wan model more closely (its
``tools/convert.py``, llama.cpp's quantiser with that pack's ``lcpp.patch``, then ``fix_5d_tensors.py``): the
plain types its converter picks, the tensors its quantiser leaves alone, a ``Q4_K_M`` file's ``Q6_K`` layers, the
file type in ``general.file_type``.
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
    return _finish(writer, partial, target)


def _finish(writer: gguf.GGUFWriter, partial: Path, target: Path) -> Path:
    """Write the header, metadata and tensors, then move the finished file into place (never a half-written one)."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(target)
    return target


def _add(writer: gguf.GGUFWriter, name: str, tensor: torch.Tensor, kind: str) -> None:
    values = tensor.float().numpy()
    quant = quantised_type(name, values.shape, kind) if values.ndim <= 4 else gguf.GGMLQuantizationType.F32
    if quant == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
        return
    writer.add_tensor(name, gguf.quants.quantize(values, quant), raw_dtype=quant)


#: What llama.cpp's quantiser, patched by ComfyUI-GGUF, never quantises in a Wan model (``lcpp.patch``; it
#: quantises only names ending in ``weight``, so ``blocks.N.modulation`` stays plain too).
WAN_KEPT = (
    "modulation.",
    "patch_embedding.",
    "text_embedding.",
    "time_projection.",
    "time_embedding.",
    "img_emb.",
    "head.",
)
#: A ``Q4_K_M`` Wan file's layers in ``Q6_K`` (attention values, feed-forward outputs), by that patch's rules.
Q6_K_LAYERS = (".v.weight", ".ffn.2.weight")
#: The scale fields (byte ranges, float16) of the K blocks written at random (``gguf`` does not quantise to them).
K_SCALES = {"Q4_K": ((0, 2), (2, 4)), "Q6_K": ((208, 210),)}


def write_comfyui_gguf(source: Path, target: Path, file_type: str, plain: str = "F16", seed: int = 0) -> Path:
    """``source`` (a Wan 2.1 model, safetensors) as ComfyUI-GGUF's tools leave it: its converter's plain types
    (``plain``, the source's: F16 throughout, or BF16 with vectors, small tensors and ``modulation`` in F32),
    quantised to ``file_type`` (``Q8_0``, or ``Q4_K_M``: ``Q4_K`` blocks, ``Q6_K`` for the layers above, random
    blocks of finite scales since ``gguf`` cannot quantise K types) where the quantiser would, the 5-D patch
    embedding put back as F32 after its bias, and ``general.file_type`` set; made once, then reused."""
    if target.exists() and target.stat().st_mtime >= source.stat().st_mtime:
        return target
    partial = target.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), "wan")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{file_type}"])
    rng = np.random.default_rng(seed)
    with safe_open(str(source), framework="pt") as tensors:
        names = list(tensors.keys())
        five_d = [name for name in names if len(tensors.get_slice(name).get_shape()) > 4]
        waiting = set(five_d)
        for name in (name for name in names if name not in five_d):
            _add_as_comfyui_gguf(writer, name, tensors.get_tensor(name), file_type, plain, rng)
            weight = name.replace(".bias", ".weight")
            if weight in waiting:  # fix_5d_tensors.py adds it after the tensor it is found beside
                writer.add_tensor(weight, tensors.get_tensor(weight).float().numpy())
                waiting.discard(weight)
        for name in sorted(waiting):
            writer.add_tensor(name, tensors.get_tensor(name).float().numpy())
    return _finish(writer, partial, target)


def _add_as_comfyui_gguf(
    writer: gguf.GGUFWriter, name: str, tensor: torch.Tensor, file_type: str, plain: str, rng: np.random.Generator
) -> None:
    values = tensor.float().numpy()
    quant = _comfyui_gguf_type(name, values.shape, file_type)
    if quant in ("Q4_K", "Q6_K"):
        writer.add_tensor(name, _random_k_blocks(quant, values.shape, rng), raw_dtype=gguf.GGMLQuantizationType[quant])
        return
    if quant is None:  # kept in its converter's type
        small = values.ndim == 1 or values.size <= SMALL or "modulation" in name
        quant = "F32" if plain == "BF16" and small else plain
    kind = gguf.GGMLQuantizationType[quant]
    writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)


def _comfyui_gguf_type(name: str, shape: tuple[int, ...], file_type: str) -> str | None:
    """The block type llama.cpp's patched quantiser gives a Wan tensor for ``file_type``, ``None`` where it keeps
    the converter's type (vectors, the tensors it leaves alone, rows that are not whole blocks)."""
    if len(shape) < 2 or not name.endswith("weight") or any(kept in name for kept in WAN_KEPT):
        return None
    quant = file_type
    if file_type == "Q4_K_M":
        quant = "Q6_K" if name.endswith(Q6_K_LAYERS) else "Q4_K"
    values = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[quant]][0]
    return quant if shape[-1] % values == 0 else None


def _random_k_blocks(kind: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Rows of random ``kind`` blocks for a tensor of ``shape``, their scales small finite float16 values."""
    values, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    rows, blocks = int(np.prod(shape[:-1])), shape[-1] // values
    data = rng.integers(0, 256, size=(rows, blocks, size), dtype=np.uint8)
    for start, stop in K_SCALES[kind]:
        scales = rng.normal(0, 1e-3, size=(rows, blocks)).astype(np.float16)
        data[..., start:stop] = scales.view(np.uint8).reshape(rows, blocks, 2)
    return data.reshape(*shape[:-1], blocks * size)


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
