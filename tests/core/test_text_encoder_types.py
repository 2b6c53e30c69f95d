"""The recipes of ComfyUI's text-encoder types: what each takes, and what a mismatch says."""

from __future__ import annotations

import pytest

from core.detection.text_encoder_types import RECIPES, check_type, types_taking


@pytest.mark.parametrize(
    ("clip_type", "kinds"),
    [
        ("stable_diffusion", ["CLIP-L"]),
        ("stable_diffusion", ["Qwen3-0.6B"]),  # Anima's encoder, under the default type
        ("sdxl", ["CLIP-L", "CLIP-G"]),
        ("sdxl", ["CLIP-G", "CLIP-L"]),  # the order of the files does not matter, as in ComfyUI
        ("sd3", ["CLIP-L"]),
        ("sd3", ["CLIP-L", "CLIP-G", "T5-XXL"]),
        ("flux", ["T5-XXL", "CLIP-L"]),
        ("wan", ["UMT5-XXL"]),
        ("chroma", ["T5-XXL"]),
        ("hidream", ["CLIP-L", "CLIP-G", "T5-XXL", "Llama-3 8B"]),
        ("ace", ["UMT5-Base"]),
        ("stable_audio", ["T5-Base"]),
        ("lumina2", ["Qwen3-4B"]),  # Z-Image's encoder, loaded as ComfyUI's own workflows do
        ("ltxv", ["Gemma-3 12B", "anything"]),  # a type we do not check: the running ComfyUI decides
    ],
)
def test_what_a_type_takes_passes(clip_type, kinds):
    assert check_type(clip_type, kinds).problem is None


@pytest.mark.parametrize(
    ("clip_type", "kinds", "wanted", "suits"),
    [
        ("flux", ["CLIP-L"], "CLIP-L + T5-XXL", ("stable_diffusion", "sd3", "hidream")),
        ("wan", ["T5-XXL"], "UMT5-XXL", ("sd3", "chroma", "pixart", "mochi", "hidream")),
        ("sdxl", ["CLIP-L"], "CLIP-G + CLIP-L", ("stable_diffusion", "sd3", "hidream")),
        ("sd3", ["UMT5-XXL"], "CLIP-G", ("wan",)),
        ("qwen_image", ["Qwen3-4B"], "Qwen2.5-VL 7B", ("flux", "lumina2")),
        ("stable_audio", ["UMT5-Base"], "T5-Base", ("ace",)),  # ComfyUI would build ACE-Step's encoder
    ],
)
def test_a_mismatch_names_what_the_type_takes_and_the_types_that_take_the_files(clip_type, kinds, wanted, suits):
    check = check_type(clip_type, kinds)
    assert wanted in check.problem and " + ".join(kinds) in check.problem
    assert check.suits == suits


def test_the_types_offered_limit_the_suggestions():
    assert check_type("flux", ["CLIP-L"], offered=["stable_diffusion", "flux"]).suits == ("stable_diffusion",)


def test_every_recipe_is_sorted_so_the_order_of_files_never_matters():
    for recipes in RECIPES.values():
        for recipe in recipes:
            assert list(recipe) == sorted(recipe)
    assert types_taking(["T5-XXL", "CLIP-L"]) == types_taking(["CLIP-L", "T5-XXL"])
