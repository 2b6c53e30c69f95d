"""The in-process setting of the GGUF text-encoder tests: a synthetic encoder as a Q8_0 GGUF under llama.cpp's
names and its dequantised twin (the oracle's model), in ComfyUI's text_encoders folder, with the pack imported."""

from __future__ import annotations

import gc
import importlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf

from tools.gguf_files import text_encoder_gguf


def gguf_encoder_in_process(
    tmp_path_factory: Any, stem: str, write_source: Callable[[Path], Path], architecture: gguf.MODEL_ARCH, layers: int
) -> Iterator[tuple[Any, Callable[[str], Any], Path, Path]]:
    """Yield ``(model_management, pack module getter, GGUF file, twin)`` for a module fixture; unload after."""
    from tools.comfy_inprocess import import_comfy, import_pack

    mm = import_comfy()
    folder = tmp_path_factory.mktemp(f"gguf_{stem}")
    source = write_source(tmp_path_factory.mktemp(f"{stem}_source") / f"{stem}_synthetic.safetensors")
    encoder, twin = text_encoder_gguf(source, folder, architecture, layers)
    importlib.import_module("folder_paths").add_model_folder_path("text_encoders", str(folder))
    pack = import_pack()
    yield mm, lambda name: importlib.import_module(f"{pack.__name__}.{name}"), encoder, twin
    mm.unload_all_models()
    gc.collect()
