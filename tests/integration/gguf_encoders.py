"""The in-process setting of the GGUF text-encoder tests: a synthetic encoder as a Q8_0 GGUF under llama.cpp's
names and its dequantised twin (the oracle's model), in ComfyUI's text_encoders folder, with the pack imported."""

from __future__ import annotations

import gc
import importlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf

from tools.fixtures.gguf_files import text_encoder_gguf


def gguf_encoder_in_process(
    folder: Path, stem: str, write_source: Callable[[Path], Path], architecture: gguf.MODEL_ARCH, layers: int
) -> Iterator[tuple[Any, Callable[[str], Any], Path, Path]]:
    """Yield ``(model_management, pack module getter, GGUF file, twin)`` for a module fixture, its files written
    in ``folder``; unload after."""
    from tools.runtime.inprocess import import_comfy, import_pack

    mm = import_comfy()
    listed, unlisted = folder / "text_encoders", folder / "source"  # the source is not in ComfyUI's list
    listed.mkdir()
    unlisted.mkdir()
    source = write_source(unlisted / f"{stem}_synthetic.safetensors")
    encoder, twin = text_encoder_gguf(source, listed, architecture, layers)
    importlib.import_module("folder_paths").add_model_folder_path("text_encoders", str(listed))
    pack = import_pack()
    yield mm, lambda name: importlib.import_module(f"{pack.__name__}.{name}"), encoder, twin
    mm.unload_all_models()
    gc.collect()
