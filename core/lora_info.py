"""LoRA files from their header: naming format, algorithm, rank, target model, and whether ComfyUI maps it.

A LoRA is a set of small tensors per adapted layer, named after that layer with a suffix per tensor. The
suffix tells the algorithm and the naming convention; the layer names tell which model it was trained for;
the shapes tell the rank and the model's widths.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from .headers import TensorInfo

# suffix -> (algorithm, naming style), longest first so ".lora_B.default.weight" wins over ".lora_B.weight"
_SUFFIXES: tuple[tuple[str, str, str], ...] = (
    (".lora_B.default.weight", "LoRA", "PEFT (default adapter)"),
    (".lora_A.default.weight", "LoRA", "PEFT (default adapter)"),
    (".lora_linear_layer.up.weight", "LoRA", "diffusers (transformers text encoder)"),
    (".lora_linear_layer.down.weight", "LoRA", "diffusers (transformers text encoder)"),
    ("_lora.up.weight", "LoRA", "diffusers attention processor"),
    ("_lora.down.weight", "LoRA", "diffusers attention processor"),
    (".lora_up.weight", "LoRA", "kohya / LyCORIS"),
    (".lora_down.weight", "LoRA", "kohya / LyCORIS"),
    (".lora_mid.weight", "LoRA", "kohya / LyCORIS"),
    (".lora_B.weight", "LoRA", "PEFT / diffusers"),
    (".lora_A.weight", "LoRA", "PEFT / diffusers"),
    (".lora.up.weight", "LoRA", "diffusers (.lora.up/.lora.down)"),
    (".lora.down.weight", "LoRA", "diffusers (.lora.up/.lora.down)"),
    (".lora_B", "LoRA", "PEFT (no .weight)"),
    (".lora_A", "LoRA", "PEFT (no .weight)"),
    (".hada_w1_a", "LoHa", "LyCORIS"),
    (".hada_w1_b", "LoHa", "LyCORIS"),
    (".hada_w2_a", "LoHa", "LyCORIS"),
    (".hada_w2_b", "LoHa", "LyCORIS"),
    (".lokr_w1", "LoKr", "LyCORIS"),
    (".lokr_w2", "LoKr", "LyCORIS"),
    (".lokr_w1_a", "LoKr", "LyCORIS"),
    (".lokr_w1_b", "LoKr", "LyCORIS"),
    (".lokr_w2_a", "LoKr", "LyCORIS"),
    (".lokr_w2_b", "LoKr", "LyCORIS"),
    (".oft_blocks", "OFT", "LyCORIS"),
    (".a1.weight", "GLoRA", "LyCORIS"),
    (".b1.weight", "GLoRA", "LyCORIS"),
)
_AUX = (
    ".alpha",
    ".dora_scale",
    ".lora_up.bias",
    ".hada_t1",
    ".hada_t2",
    ".lokr_t2",
    ".a2.weight",
    ".b2.weight",
    ".rescale",
    ".reshape_weight",
    ".diff",
    ".diff_b",
    ".set_weight",
    ".w_norm",
    ".b_norm",
)
_DOWN = (
    ".lora_down.weight",
    ".lora_A.weight",
    "_lora.down.weight",
    ".lora.down.weight",
    ".lora_linear_layer.down.weight",
    ".lora_A.default.weight",
    ".lora_A",
)
# diffusers UNet attention projections saved with the "unet." prefix and PEFT-style suffixes: ComfyUI 0.3.75 maps
# these names only in the attention-processor spelling, so such layers are not loaded.
_PRIMARY = (*_DOWN, ".hada_w1_a", ".lokr_w1", ".lokr_w1_a", ".oft_blocks", ".a1.weight")
_UNMAPPED = re.compile(r"^unet\..*\.(to_q|to_k|to_v|to_out\.0)\.(lora_A|lora_B|lora\.down|lora\.up)\.weight$")
_CONTEXT = re.compile(r"attn2[._](?:processor\.)?to_k(?:_lora)?[._]")
_CONTEXT_FAMILY = {768: "SD15", 1024: "SD20", 2048: "SDXL"}


@dataclass(frozen=True)
class LoraInfo:
    """What a LoRA file holds, and whether ComfyUI 0.3.75's LoRA loader maps its layers."""

    naming: tuple[str, ...]
    algorithms: tuple[str, ...]
    ranks: tuple[int, ...]
    layers: int
    targets: tuple[str, ...]
    target_family: str | None
    unmapped_layers: int

    @property
    def rank(self) -> int | None:
        """The rank most layers use."""
        return self.ranks[0] if self.ranks else None

    @property
    def comfyui_loads(self) -> str:
        """``"yes"``, or how much of it ComfyUI's key maps leave out."""
        if self.unmapped_layers == 0:
            return "yes"
        return f"partly: {self.unmapped_layers} of {self.layers} layers use names ComfyUI does not map"


def is_lora(tensors: Mapping[str, TensorInfo]) -> bool:
    """True when most tensors carry a LoRA-family suffix and at least one is a primary (down/A-side) tensor."""
    suffixes = tuple(s for s, _, _ in _SUFFIXES) + _AUX
    hits = sum(1 for name in tensors if name.endswith(suffixes))
    return bool(tensors) and hits * 2 >= len(tensors) and any(name.endswith(_PRIMARY) for name in tensors)


def describe_lora(tensors: Mapping[str, TensorInfo]) -> LoraInfo:
    """Describe a LoRA file from its tensor names and shapes."""
    layers: dict[str, tuple[str, str]] = {}
    ranks: Counter[int] = Counter()
    for name, info in tensors.items():
        for suffix, algorithm, naming in _SUFFIXES:
            if name.endswith(suffix):
                layers.setdefault(name[: -len(suffix)], (algorithm, naming))
                if suffix in _DOWN and info.shape:
                    ranks[info.shape[0]] += 1
                break
    unmapped = {name.rsplit(".", 3)[0] for name in tensors if _UNMAPPED.match(name)}
    return LoraInfo(
        naming=tuple(sorted({naming for _, naming in layers.values()})),
        algorithms=tuple(sorted({algorithm for algorithm, _ in layers.values()})),
        ranks=tuple(rank for rank, _ in ranks.most_common()),
        layers=len(layers),
        targets=_targets(layers),
        target_family=_family(tensors),
        unmapped_layers=len(unmapped),
    )


def _targets(layers: Mapping[str, object]) -> tuple[str, ...]:
    found = set()
    for name in layers:
        if name.startswith(("lora_unet_", "unet.", "diffusion_model.", "transformer.", "lycoris_")) or "blocks" in name:
            found.add("diffusion model")
        elif name.startswith(("lora_te2_", "text_encoder_2.")):
            found.add("text encoder 2")
        elif name.startswith(("lora_te", "text_encoder.", "text_encoders.")):
            found.add("text encoder")
    return tuple(sorted(found))


def _family(tensors: Mapping[str, TensorInfo]) -> str | None:
    names = list(tensors)
    for name in names:
        if _CONTEXT.search(name) and name.endswith(_DOWN):
            family = _CONTEXT_FAMILY.get(tensors[name].shape[-1])
            if family is not None:
                return "SDXL" if any(n.startswith(("lora_te2_", "text_encoder_2.")) for n in names) else family
    if any("double_blocks" in n or "single_transformer_blocks" in n for n in names):
        return "Flux"
    if any("joint_blocks" in n for n in names):
        return "SD3"
    if any(re.search(r"blocks[._]\d+[._](self_attn|cross_attn)", n) for n in names):
        return "Wan"
    return None
