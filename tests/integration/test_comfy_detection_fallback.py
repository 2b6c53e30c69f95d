"""A file our header rules do not know, asked of the running ComfyUI's own detection before it is refused.

``detect_with_comfyui`` is what Load Checkpoint With Device calls when our table says "unknown" (a family the
user's ComfyUI knows and our table does not yet). Here it runs on real layouts in this process, against the
running ComfyUI, and must agree with our rules wherever those know the file: the same class, the same prefix,
the same components weighing the same bytes, and a family name that says who recognised it.
"""

from __future__ import annotations

import importlib
import json

import pytest

from core.detection.detect import detect_header
from core.detection.headers import read_header
from tools.fixtures.layouts import layouts, write_sparse_safetensors

CHECKPOINTS = ("sd15.checkpoint.json", "sdxl_base.checkpoint.json", "flux1_dev.diffusion_model.json")


@pytest.fixture(scope="module")
def fallback(comfy_runtime):
    from tools.runtime.inprocess import import_comfy, import_pack

    import_comfy()
    pack = import_pack()
    return importlib.import_module(f"{pack.__name__}.nodes.bridge.comfy_detection")


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_comfyui_detection_describes_a_file_as_our_rules_do(fallback, name, tmp_path):
    layout = layouts()[name]
    path = write_sparse_safetensors(layout, tmp_path / "model.safetensors")
    header = read_header(path)
    ours = detect_header(header)
    theirs = fallback.detect_with_comfyui(header)
    assert theirs is not None and theirs.comfy_class == ours.comfy_class
    assert fallback.COMFY_DETECTED in theirs.family
    assert (theirs.kind, theirs.prefix) == (ours.kind, ours.prefix)
    weigh = lambda d: {(c.name, c.stored_bytes, c.tensor_count) for c in d.components}  # noqa: E731
    assert weigh(theirs) == weigh(ours)


def test_a_file_comfyui_does_not_know_either_stays_unknown(fallback, tmp_path):
    layout = {"tensors": {"encoder.weight": [[8, 8], "F16"], "decoder.weight": [[8, 8], "F16"]}}
    path = write_sparse_safetensors(layout, tmp_path / "nothing.safetensors")
    assert fallback.detect_with_comfyui(read_header(path)) is None


def test_the_loader_takes_what_the_running_comfyui_builds(fallback, tmp_path):
    """A Wan file whose metadata marks it causal: ComfyUI 0.28 builds WAN21_CausalAR_T2V (our rules agree), while
    0.3.x, which lacks that class and reads no metadata for Wan, builds WAN21_T2V: the loader must take that."""
    loader = importlib.import_module(fallback.__name__.replace("nodes.bridge.comfy_detection", "nodes.load_checkpoint"))
    surface = importlib.import_module(fallback.__name__.replace("bridge.comfy_detection", "surface"))
    metadata = {"config": json.dumps({"transformer": {"causal_ar": True}})}
    path = write_sparse_safetensors(
        layouts()["wan21_t2v_1_3b.diffusion_model.json"], tmp_path / "w.safetensors", metadata
    )
    header = read_header(path)
    ours = detect_header(header)
    assert ours.comfy_class == "WAN21_CausalAR_T2V"
    seen = loader.detection_for_this_comfyui(header, ours)
    if surface.has_model_class("WAN21_CausalAR_T2V"):
        assert seen is ours
    else:
        assert seen.comfy_class == "WAN21_T2V" and fallback.COMFY_DETECTED in seen.family
