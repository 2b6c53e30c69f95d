"""VAEs and text encoders: what kind each is, from key names and shapes, and what a component weighs.

Used for standalone VAE and text-encoder files and for the VAE and text encoders inside a checkpoint. Both
rule tables are read top to bottom, first match wins, in the order ComfyUI 0.3.75 applies them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .headers import TensorInfo
from .keyview import KeyView

#: Bytes per element of a floating-point weight stored in each candidate dtype.
CANDIDATE_DTYPES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "fp64": 8}

Rule = tuple[Callable[[KeyView], bool], Callable[[KeyView], str]]


def _has(key: str) -> Callable[[KeyView], bool]:
    return lambda view: view.has(key)


def _named(name: str) -> Callable[[KeyView], str]:
    return lambda _view: name


def _kl_vae(view: KeyView) -> str:
    conv_in = view.shape("decoder.conv_in.weight")
    if conv_in[1] == 64:
        return "HunyuanImage 2.1 VAE (64 channels)"
    if conv_in[1] == 32 and len(conv_in) == 5:
        return "HunyuanImage refiner VAE"
    if not view.has("encoder.down.2.downsample.conv.weight") and not view.has("decoder.up.3.upsample.conv.weight"):
        return "SD x4 upscaler VAE"
    if view.has("bn.running_mean"):
        return "Flux.2 VAE"
    if view.has("post_quant_conv.weight") or view.has("decoder.post_quant_conv.weight"):
        return f"KL VAE, {conv_in[1]} latent channels (SD1/SD2/SDXL)"
    return f"KL VAE, {conv_in[1]} latent channels (SD3/Flux)"


def _wan_vae(view: KeyView) -> str:
    return "Wan 2.2 VAE" if view.has("decoder.upsamples.0.upsamples.0.residual.2.weight") else "Wan 2.1 VAE"


def _mochi(view: KeyView) -> bool:
    keys = (
        "blocks.2.blocks.3.stack.5.weight",
        "decoder.blocks.2.blocks.3.stack.5.weight",
        "layers.4.layers.1.attn_block.attn.qkv.weight",
        "encoder.layers.4.layers.1.attn_block.attn.qkv.weight",
    )
    return any(view.has(k) for k in keys)


VAE_RULES: tuple[Rule, ...] = (
    (_has("decoder.up_blocks.0.resnets.0.norm1.weight"), _named("KL VAE (diffusers names)")),
    (_has("decoder.mid.block_1.mix_factor"), _named("SVD temporal VAE")),
    (_has("taesd_decoder.1.weight"), _named("TAESD")),
    (_has("vquantizer.codebook.weight"), _named("Stable Cascade stage A")),
    (_has("backbone.1.0.block.0.1.num_batches_tracked"), _named("Stable Cascade effnet encoder")),
    (_has("blocks.11.num_batches_tracked"), _named("Stable Cascade previewer")),
    (_has("encoder.backbone.1.0.block.0.1.num_batches_tracked"), _named("Stable Cascade stage C coder")),
    (_has("decoder.conv_in.weight"), _kl_vae),
    (_has("decoder.layers.1.layers.0.beta"), _named("Stable Audio Oobleck VAE")),
    (_mochi, _named("Mochi VAE")),
    (_has("decoder.up_blocks.0.res_blocks.0.conv1.conv.weight"), _named("LTX-Video VAE")),
    (lambda v: v.dim("decoder.conv_in.conv.weight", 1) == 32, _named("HunyuanVideo 1.5 VAE")),
    (_has("decoder.conv_in.conv.weight"), _named("HunyuanVideo VAE")),
    (_has("decoder.unpatcher3d.wavelets"), _named("Cosmos video tokenizer")),
    (_has("decoder.middle.0.residual.0.gamma"), _wan_vae),
    (_has("geo_decoder.cross_attn_decoder.ln_1.bias"), _named("Hunyuan3D shape VAE")),
    (_has("vocoder.backbone.channel_layers.0.0.bias"), _named("ACE-Step music VAE")),
    (_has("pixel_space_vae"), _named("pixel-space (no VAE)")),
    (_has("vocoder.activation_post.downsample.lowpass.filter"), _named("MMAudio VAE")),
    (_has("decoder.22.bias"), _named("TAEHV")),
)


def _t5(view: KeyView) -> str:
    width = view.shape("encoder.block.23.layer.1.DenseReluDense.wi_1.weight")[-1]
    if width == 2048:
        return "T5-XL"
    # ComfyUI treats both as T5-XXL; the vocabulary tells UMT5 (Wan) apart.
    return "UMT5-XXL" if view.dim("shared.weight", 0) == 256384 else "T5-XXL"


def _small_t5(view: KeyView) -> str:
    if view.shape("encoder.block.0.layer.0.SelfAttention.k.weight")[0] == 384:
        return "ByT5-small"
    return "UMT5-Base" if view.dim("shared.weight", 0) == 256384 else "T5-Base"  # ACE-Step's; Stable Audio's


#: Qwen3 text encoders by hidden width (Z-Image and Flux.2 Klein take the 4B, Klein 9B the 8B, Ovis the 2B).
_QWEN3 = {1024: "Qwen3-0.6B", 2048: "Qwen3-2B", 2560: "Qwen3-4B", 4096: "Qwen3-8B"}


def _llm(view: KeyView) -> str:
    width = view.shape("model.layers.0.post_attention_layernorm.weight")[0]
    if view.has("model.layers.0.self_attn.q_norm.weight"):
        return _QWEN3.get(width, f"Qwen3 ({width} wide)")
    if width == 5120:
        return (
            "Mistral-3 24B" if view.has("model.layers.39.post_attention_layernorm.weight") else "Mistral-3 24B (pruned)"
        )
    return "Llama-3 8B"


TEXT_ENCODER_RULES: tuple[Rule, ...] = (
    (_has("text_model.encoder.layers.30.mlp.fc1.weight"), _named("CLIP-G")),
    (_has("text_model.encoder.layers.22.mlp.fc1.weight"), _named("CLIP-H")),
    (_has("text_model.encoder.layers.0.mlp.fc1.weight"), _named("CLIP-L")),
    (_has("transformer.resblocks.30.ln_1.weight"), _named("CLIP-G")),  # open_clip layout (SDXL, refiners)
    (_has("transformer.resblocks.22.ln_1.weight"), _named("CLIP-H")),  # open_clip layout (SD2)
    (_has("encoder.block.23.layer.1.DenseReluDense.wi_1.weight"), _t5),
    (_has("encoder.block.23.layer.1.DenseReluDense.wi.weight"), _named("T5-XXL (v1.0)")),
    (_has("encoder.block.0.layer.0.SelfAttention.k.weight"), _small_t5),
    (
        _has("model.layers.0.post_feedforward_layernorm.weight"),
        lambda v: "Gemma-3 4B" if v.has("model.layers.0.self_attn.q_norm.weight") else "Gemma-2 2B",
    ),
    (
        lambda v: v.dim("model.layers.0.self_attn.k_proj.bias", 0) in (256, 512),
        lambda v: "Qwen2.5-VL 3B" if v.shape("model.layers.0.self_attn.k_proj.bias")[0] == 256 else "Qwen2.5-VL 7B",
    ),
    (_has("model.layers.0.post_attention_layernorm.weight"), _llm),
)


def classify(view: KeyView, rules: tuple[Rule, ...]) -> str | None:
    """The name given by the first rule that applies, or ``None``."""
    return next((name(view) for applies, name in rules if applies(view)), None)


def vae_kind(view: KeyView) -> str | None:
    """What kind of VAE the keys under ``view`` are, or ``None`` when they are no VAE we know."""
    return classify(view, VAE_RULES)


def text_encoder_kind(view: KeyView) -> str | None:
    """What kind of text encoder the keys under ``view`` are, or ``None``."""
    for inner in ("", "transformer.", "model."):  # checkpoints wrap encoders in one more level
        found = classify(KeyView(view.tensors, view.prefix + inner), TEXT_ENCODER_RULES)
        if found is not None:
            return found
    return None


@dataclass(frozen=True)
class Component:
    """One part of a model file (the diffusion model, a text encoder, the VAE, ...) and what it weighs.

    ``bytes_by_dtype`` is what the component's weights take when stored in each candidate dtype: floating
    tensors are converted, integer ones (token ids, tokenizer blobs) and quantised ones (a GGUF's GGML blocks,
    dequantised only as they compute) keep their size.
    """

    name: str
    kind: str
    prefix: str
    tensor_count: int
    parameter_count: int
    stored_dtypes: tuple[str, ...]
    stored_bytes: int
    bytes_by_dtype: Mapping[str, int]


def measure(name: str, kind: str, prefix: str, tensors: list[TensorInfo]) -> Component:
    """Count and weigh ``tensors`` as one component."""
    floats, fixed = _convertible(tensors)
    return Component(
        name=name,
        kind=kind,
        prefix=prefix,
        tensor_count=len(tensors),
        parameter_count=sum(t.numel for t in tensors),
        stored_dtypes=tuple(sorted({t.dtype for t in tensors})),
        stored_bytes=sum(t.nbytes for t in tensors),
        bytes_by_dtype={dtype: floats * size + fixed for dtype, size in CANDIDATE_DTYPES.items()},
    )


def _convertible(tensors: list[TensorInfo]) -> tuple[int, int]:
    """Values that take the dtype chosen (plain floats), and bytes that keep their size (integers, GGML blocks)."""
    convertible = [t for t in tensors if t.is_float and not t.is_quantized]
    floats = sum(t.numel for t in convertible)
    return floats, sum(t.nbytes for t in tensors) - sum(t.nbytes for t in convertible)
