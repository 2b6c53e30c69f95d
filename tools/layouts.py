"""Real model layouts (names, shapes, dtypes) from ``tests/data``, and sparse safetensors files made from them.

A sparse file has a real header and a hole where the weights would be: it takes no disk space, reads back
as zeros, and lets tests and benchmarks open, detect and load a 7 GB SDXL file on any machine.
"""

from __future__ import annotations

import gzip
import json
import math
import struct
from functools import cache
from pathlib import Path
from typing import Any

from tools.layout_specs import ADDED
from tools.runtime import REPO

LAYOUTS = REPO / "tests" / "data" / "model_layouts.json.gz"
#: Bytes per element of each safetensors dtype a layout holds (BOOL: RT-DETR v4's anchor mask).
ITEM_SIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "U8": 1,
    "BOOL": 1,
}


#: The layouts of the families each newer ComfyUI added (0.28.0, 0.33.0: ``tools/make_layouts.py``), by version.
NEW_LAYOUTS = {version: REPO / "tests" / "data" / f"model_layouts_comfyui_{version}.json.gz" for version in ADDED}


@cache
def layouts() -> dict[str, dict[str, Any]]:
    """Every layout, by its file name (e.g. ``sdxl_base.checkpoint.json``)."""
    with gzip.open(LAYOUTS, "rb") as handle:
        return json.loads(handle.read())


@cache
def new_layouts() -> dict[str, dict[str, Any]]:
    """Every layout of a family ComfyUI 0.28.0 or 0.33.0 added, by its file name (``krea2.diffusion_model.json``).

    One mapping for both: tests run the same checks on each, and skip the ComfyUI side for a class the running
    ComfyUI lacks. A name both files held would hide one layout, so it is refused.

    Raises:
        ValueError: two files hold a layout of the same name.
    """
    merged: dict[str, dict[str, Any]] = {}
    for path in NEW_LAYOUTS.values():
        with gzip.open(path, "rb") as handle:
            more = json.loads(handle.read())
        if merged.keys() & more.keys():
            raise ValueError(f"{path.name} repeats layouts: {sorted(merged.keys() & more.keys())}")
        merged |= more
    return merged


def write_sparse_safetensors(layout: dict[str, Any], path: Path, metadata: dict[str, str] | None = None) -> Path:
    """Write ``layout`` as a safetensors file whose data is a hole (all zeros, no disk used)."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in sorted(layout["tensors"]):
        shape, dtype = layout["tensors"][name]
        size = math.prod(shape) * ITEM_SIZE[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as writers do
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)))
        handle.write(raw)
        handle.truncate(8 + len(raw) + offset)
    return path
