"""Which text encoders each of ComfyUI's text-encoder types takes, so a mismatch is refused before any weight
is read.

ComfyUI's CLIP loaders pick the encoder class from the type the user chose *and* the files given, and fall back
to a default class when they do not match: a CLIP-L file loaded as type ``flux`` quietly becomes an SD1.5 text
encoder, and sampling fails much later on a shape nobody can relate to the loader. The recipes here are those
ComfyUI documents for its loaders (CLIPLoader, DualCLIPLoader, TripleCLIPLoader, QuadrupleCLIPLoader), in the
names :mod:`core.detection.components` gives text encoders. Types not listed here (newer ones, or ones whose
encoders our rules do not name) are not checked: the running ComfyUI decides. Where ComfyUI picks the class from
the file alone whatever the type (a Qwen3-4B file is Z-Image's encoder as type ``lumina2``), the recipes follow
the families that take the file, so a workflow that works with ComfyUI's loaders is never refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import combinations

Recipe = tuple[str, ...]


def _subsets(*kinds: str) -> tuple[Recipe, ...]:
    """Every non-empty combination of ``kinds`` (types that take any of their encoders, alone or together)."""
    return tuple(tuple(sorted(c)) for n in range(1, len(kinds) + 1) for c in combinations(kinds, n))


def _one(*kinds: str) -> tuple[Recipe, ...]:
    return tuple((kind,) for kind in kinds)


#: Type (as ComfyUI names it, lower case) -> the encoder combinations it takes (sorted kind names).
RECIPES: dict[str, tuple[Recipe, ...]] = {
    # SDXL's pair loaded as the default type builds SDXL's encoder, and CLIP-G alone the SDXL refiner's.
    # Anima's Qwen3-0.6B: ComfyUI builds its encoder whatever the type, and Anima's workflows leave the default.
    "stable_diffusion": (*_one("CLIP-L", "CLIP-H", "CLIP-G", "Qwen3-0.6B"), ("CLIP-G", "CLIP-L")),
    "sdxl": (("CLIP-G", "CLIP-L"), ("CLIP-G",)),
    "stable_cascade": (("CLIP-G",),),
    "sd3": _subsets("CLIP-L", "CLIP-G", "T5-XXL"),
    "flux": (("CLIP-L", "T5-XXL"), ("Qwen3-4B",), ("Qwen3-8B",)),  # Flux.1; Flux.2 Klein
    "chroma": (("T5-XXL",),),
    "pixart": (("T5-XXL",),),
    "mochi": (("T5-XXL",),),
    "cosmos": (("T5-XXL (v1.0)",),),
    "wan": (("UMT5-XXL",),),
    "stable_audio": (("T5-Base",),),
    "ace": (("UMT5-Base",),),
    "hidream": _subsets("CLIP-L", "CLIP-G", "T5-XXL", "Llama-3 8B"),
    "hunyuan_video": (("CLIP-L", "Llama-3 8B"),),
    "lumina2": (("Gemma-2 2B",), ("Gemma-3 4B",), ("Qwen3-4B",)),  # Lumina 2; NewBie; Z-Image
    "omnigen2": (("Qwen2.5-VL 3B",),),
    "qwen_image": (("Qwen2.5-VL 7B",),),
}


@dataclass(frozen=True)
class TypeCheck:
    """Whether ``kinds`` (one per file, in order) suit ``clip_type``: ``problem`` is ``None`` when they do, or
    when the type is not one we check; ``suits`` names the types that do take these files."""

    clip_type: str
    kinds: tuple[str, ...]
    problem: str | None
    suits: tuple[str, ...]


def types_taking(kinds: Iterable[str], offered: Sequence[str] | None = None) -> tuple[str, ...]:
    """The types whose recipes take exactly these encoders (among ``offered`` when given)."""
    recipe = tuple(sorted(kinds))
    return tuple(
        name for name, recipes in RECIPES.items() if recipe in recipes and (offered is None or name in offered)
    )


def check_type(clip_type: str, kinds: Sequence[str], offered: Sequence[str] | None = None) -> TypeCheck:
    """Check the encoders ``kinds`` (our names for the files' encoders) against ``clip_type``'s recipes."""
    name = clip_type.lower()
    recipes = RECIPES.get(name)
    suits = types_taking(kinds, offered)
    if recipes is None or tuple(sorted(kinds)) in recipes:
        return TypeCheck(name, tuple(kinds), None, suits)
    wanted = " or ".join(" + ".join(recipe) for recipe in recipes[:4]) + (" ..." if len(recipes) > 4 else "")
    problem = f"type {name!r} takes {wanted}; the files given are {' + '.join(kinds)}"
    return TypeCheck(name, tuple(kinds), problem, suits)
