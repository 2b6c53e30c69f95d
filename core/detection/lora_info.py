"""LoRA files from their header: naming format, algorithm, rank, the layers it adapts and the model it targets.

Which of its layers a given model takes is the host's key map's answer, not the header's: inside ComfyUI the
bridge asks ComfyUI's own key map (``nodes/bridge/lora_coverage.py``) for the layer names :func:`layer_names`
gives.

A LoRA is a set of small tensors per adapted layer, named after that layer with a suffix per tensor. The
suffix tells the algorithm and the naming convention; the layer names tell which model it was trained for;
the shapes tell the rank and the model's widths.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
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
_PRIMARY = (*_DOWN, ".hada_w1_a", ".lokr_w1", ".lokr_w1_a", ".oft_blocks", ".a1.weight")
_CONTEXT = re.compile(r"attn2[._](?:processor\.)?to_k(?:_lora)?[._]")
_CONTEXT_FAMILY = {768: "SD15", 1024: "SD20", 2048: "SDXL"}


@dataclass(frozen=True)
class LoraInfo:
    """What a LoRA file holds."""

    naming: tuple[str, ...]
    algorithms: tuple[str, ...]
    ranks: tuple[int, ...]
    layers: int
    targets: tuple[str, ...]
    target_family: str | None

    @property
    def rank(self) -> int | None:
        """The rank most layers use."""
        return self.ranks[0] if self.ranks else None


def is_lora(tensors: Mapping[str, TensorInfo]) -> bool:
    """True when most tensors carry a LoRA-family suffix and at least one is a primary (down/A-side) tensor."""
    suffixes = tuple(s for s, _, _ in _SUFFIXES) + _AUX
    hits = sum(1 for name in tensors if name.endswith(suffixes))
    return bool(tensors) and hits * 2 >= len(tensors) and any(name.endswith(_PRIMARY) for name in tensors)


def describe_lora(tensors: Mapping[str, TensorInfo]) -> LoraInfo:
    """Describe a LoRA file from its tensor names and shapes."""
    layers, ranks = _layers_and_ranks(tensors)
    return LoraInfo(
        naming=tuple(sorted({naming for _, naming in layers.values()})),
        algorithms=tuple(sorted({algorithm for algorithm, _ in layers.values()})),
        ranks=tuple(rank for rank, _ in ranks.most_common()),
        layers=len(layers),
        targets=_targets(layers),
        target_family=_family(tensors),
    )


def layer_names(names: Iterable[str]) -> frozenset[str]:
    """The names of the layers a LoRA adapts: its tensor names without their suffix (``lora_unet_..._proj_in``),
    which is what a host's LoRA key map is keyed by."""
    return frozenset(name[: -len(entry[0])] for name in names if (entry := _suffix_entry(name)) is not None)


def _suffix_entry(name: str) -> tuple[str, str, str] | None:
    """``(suffix, algorithm, naming)`` of a LoRA tensor name, or ``None`` for an auxiliary or foreign tensor."""
    return next((entry for entry in _SUFFIXES if name.endswith(entry[0])), None)


def _layers_and_ranks(tensors: Mapping[str, TensorInfo]) -> tuple[dict[str, tuple[str, str]], Counter[int]]:
    """Each patched layer with its algorithm and naming, and how often each rank occurs."""
    layers: dict[str, tuple[str, str]] = {}
    ranks: Counter[int] = Counter()
    for name, info in tensors.items():
        entry = _suffix_entry(name)
        if entry is None:
            continue
        suffix, algorithm, naming = entry
        layers.setdefault(name[: -len(suffix)], (algorithm, naming))
        if suffix in _DOWN and info.shape:
            ranks[info.shape[0]] += 1
    return layers, ranks


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


#: Families told by the block names a LoRA's keys carry, when its context width does not tell.
_BLOCK_FAMILIES: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("Flux", lambda name: "double_blocks" in name or "single_transformer_blocks" in name),
    ("SD3", lambda name: "joint_blocks" in name),
    ("Wan", lambda name: re.search(r"blocks[._]\d+[._](self_attn|cross_attn)", name) is not None),
)


def _family(tensors: Mapping[str, TensorInfo]) -> str | None:
    names = list(tensors)
    by_context = _context_family(tensors)
    if by_context is not None:
        return "SDXL" if any(n.startswith(("lora_te2_", "text_encoder_2.")) for n in names) else by_context
    return next((family for family, marks in _BLOCK_FAMILIES if any(marks(n) for n in names)), None)


def _context_family(tensors: Mapping[str, TensorInfo]) -> str | None:
    """The family whose cross-attention context width a LoRA's context-side tensors have."""
    for name, info in tensors.items():
        if _CONTEXT.search(name) and name.endswith(_DOWN):
            family = _CONTEXT_FAMILY.get(info.shape[-1])
            if family is not None:
                return family
    return None
