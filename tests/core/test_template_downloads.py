"""The family templates' notes say what a user downloads: each file's size, computed from the layout of the model
it holds (the tensors' shapes and the dtypes the file is published in), and a login where the repository is gated.
The notes used to give the size in memory only (fp8), not what the download costs."""

from __future__ import annotations

import gzip
import json
import math
import re
from functools import cache
from pathlib import Path

import pytest

from tools.templates.families import FAMILIES, FLUX_GGUF_EXAMPLE
from tools.templates.models import DOWNLOAD_LAYOUTS, GATED, MODELS

LAYOUTS = Path(__file__).resolve().parents[1] / "data" / "model_layouts.json.gz"
BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "U8": 1}
NOTES = {family.title: family.note for family in (*FAMILIES, FLUX_GGUF_EXAMPLE)}


@cache
def layouts() -> dict:
    with gzip.open(LAYOUTS) as handle:
        return json.load(handle)


def download_gb(name: str) -> float:
    """The released file ``name``'s size in GB (10**9 bytes), from its layout."""
    layout, per_parameter = DOWNLOAD_LAYOUTS[name]
    tensors = layouts()[layout]["tensors"]
    if per_parameter is None:
        return sum(math.prod(shape) * BYTES[dtype] for shape, dtype in tensors.values()) / 1e9
    return sum(math.prod(shape) for shape, _dtype in tensors.values()) * per_parameter / 1e9


def stated(note: str) -> dict[str, float]:
    """The sizes a note gives: ``<file> (<n> GB to download``, by the file's name without its suffix."""
    return {name: float(size) for name, size in re.findall(r"([\w.\-]+) \((\d+(?:\.\d+)?) GB to download", note)}


@pytest.mark.parametrize("title", sorted(NOTES))
def test_each_size_a_note_gives_is_the_download_and_each_gated_file_says_log_in(title):
    note = NOTES[title]
    sizes = stated(note)
    assert sizes, f"{title}: its note gives no download size"
    for stem, size in sizes.items():
        name = next(name for name in DOWNLOAD_LAYOUTS if name.rsplit(".", 1)[0] == stem)
        assert name in MODELS, name  # a file the templates name
        assert download_gb(name) == pytest.approx(size, rel=0.03), (stem, download_gb(name))
    gated = [name for name in GATED if name.rsplit(".", 1)[0] in sizes]
    assert ("log in to Hugging Face" in note) == bool(gated), (title, gated)
    assert ("no login needed" in note) == (not gated), title
