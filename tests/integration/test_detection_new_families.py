"""The families ComfyUI 0.28 and 0.33 added, on layouts made from that ComfyUI's own classes by
``tools/fixtures/make_layouts.py``.

For every layout in ``tests/data/model_layouts_comfyui_0.28.0.json.gz`` and ``..._0.33.0.json.gz``: our header
rules name the class the layout was built from, and the running ComfyUI, when it has that class, detects the same
from meta tensors. On a ComfyUI without the class (0.3.75 and 0.3.52 for all of them, 0.28.0 for 0.33's) only our
side can be checked, and the ComfyUI side says why it skips.
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from core.detection.detect import detect_header
from core.detection.headers import SAFETENSORS_DTYPES, FileHeader, TensorInfo, read_header
from tools.fixtures.layouts import layouts, new_layouts, write_sparse_safetensors
from tools.runtime.provision import DEFAULT_VERSION

NAMES = sorted(new_layouts())


def header_of(name: str) -> FileHeader:
    tensors = {k: TensorInfo(k, dtype, tuple(shape)) for k, (shape, dtype) in new_layouts()[name]["tensors"].items()}
    return FileHeader(name, "safetensors", tensors)


@pytest.fixture(scope="module")
def comfy(comfy_runtime):
    """ComfyUI's detection module and the names of the model classes it builds."""
    from tools.runtime.inprocess import import_comfy

    import_comfy()
    supported = importlib.import_module("comfy.supported_models")
    return importlib.import_module("comfy.model_detection"), {cls.__name__ for cls in supported.models}


def test_the_files_hold_the_families_they_were_made_for():
    assert len(NAMES) >= 28
    classes = {layout["comfy_detected"] for layout in new_layouts().values()}
    assert {"ZImagePixelSpace", "HiDreamO1", "Krea2", "LTXAV"} <= classes  # 0.28's
    assert {"MiniMaxH3", "MiniMaxMusic3", "MageFlow"} <= classes  # 0.33's
    assert all(layout["kind"] == "diffusion_model" for layout in new_layouts().values())


@pytest.mark.parametrize("name", NAMES)
def test_our_header_rules_name_the_class_comfyui_built_it_from(name):
    layout = new_layouts()[name]
    found = detect_header(header_of(name))
    assert found.kind == "diffusion_model", found.reason
    assert found.comfy_class == layout["comfy_detected"], found.candidates
    assert found.model_type == layout["comfy_detection"]["model_type"]
    assert found.prefix == ""
    assert found.components[0].name == "diffusion_model"
    assert found.components[0].parameter_count == layout["param_count"]


@pytest.mark.parametrize("name", NAMES)
def test_a_sparse_file_of_the_layout_reads_back_as_the_same_class(name, tmp_path):
    """As a real file on disk (every dtype a layout holds, BOOL and I64 included), not only as a header in memory."""
    layout = new_layouts()[name]
    header = read_header(write_sparse_safetensors(layout, tmp_path / "model.safetensors"))
    assert {k: [list(t.shape), t.dtype] for k, t in header.tensors.items()} == layout["tensors"]
    assert detect_header(header).comfy_class == layout["comfy_detected"]


@pytest.mark.parametrize("name", NAMES)
def test_the_running_comfyui_detects_the_same_class(comfy, name):
    model_detection, classes = comfy
    wanted = new_layouts()[name]["comfy_detected"]
    if wanted not in classes:
        pytest.skip(f"ComfyUI {DEFAULT_VERSION} has no model class {wanted} (it came with a later ComfyUI)")
    meta = {
        k: torch.empty(shape, dtype=SAFETENSORS_DTYPES[dtype][1], device="meta")
        for k, (shape, dtype) in new_layouts()[name]["tensors"].items()
    }
    # As ComfyUI's diffusion-model loader does: strip a checkpoint prefix when there is one, then detect.
    prefix = model_detection.unet_prefix_from_state_dict(meta)
    meta = {k[len(prefix) :]: v for k, v in meta.items() if k.startswith(prefix)} or meta
    config = model_detection.model_config_from_unet(meta, "")
    assert type(config).__name__ == wanted
    assert type(config).__name__ == detect_header(header_of(name)).comfy_class


@pytest.mark.parametrize(
    ("base", "transformer", "wanted"),
    [
        ("wan21_t2v_1_3b", {"causal_ar": True}, "WAN21_CausalAR_T2V"),
        ("wan21_t2v_1_3b", {"model_type": "flow_rvs"}, "WAN21_FlowRVS"),
        ("wan21_i2v_14b", {"model_type": "animate2"}, "WAN_Animate2"),
    ],
)
def test_wan_variants_told_by_metadata_agree_with_comfyui(comfy, base, transformer, wanted):
    """Causal and FlowRVS Wan files have text-to-video's tensors, Wan Animate 2's have image-to-video 14B's (the
    class ComfyUI 0.33 builds it from has no tensor of its own): both sides read the file's ``config``."""
    model_detection, classes = comfy
    if wanted not in classes:
        pytest.skip(f"ComfyUI {DEFAULT_VERSION} has no model class {wanted} (it came with a later ComfyUI)")
    layout = layouts()[f"{base}.diffusion_model.json"]
    metadata = {"config": json.dumps({"transformer": transformer})}
    meta = {
        k: torch.empty(shape, dtype=SAFETENSORS_DTYPES[dtype][1], device="meta")
        for k, (shape, dtype) in layout["tensors"].items()
    }
    theirs = model_detection.model_config_from_unet(meta, "", metadata=metadata)
    tensors = {k: TensorInfo(k, dtype, tuple(shape)) for k, (shape, dtype) in layout["tensors"].items()}
    ours = detect_header(FileHeader("wan.safetensors", "safetensors", tensors, metadata))
    assert type(theirs).__name__ == ours.comfy_class == wanted


@pytest.mark.parametrize(("key", "width"), [("txt_norm.weight", 3584), ("proj_out.weight", 64)])
def test_mage_flow_needs_both_its_widths_or_both_sides_say_qwen_image(comfy, key, width):
    """Mage-Flow has Qwen-Image's keys: only its 2560-wide text input together with its 128 output channels name it
    (a file with one of Qwen-Image's widths instead is Qwen-Image, for ComfyUI 0.33 as for us)."""
    tensors = dict(new_layouts()["mage_flow.diffusion_model.json"]["tensors"])
    shape, dtype = tensors[key]
    tensors[key] = [[width, *shape[1:]], dtype]
    header = {k: TensorInfo(k, d, tuple(s)) for k, (s, d) in tensors.items()}
    assert detect_header(FileHeader("mage.safetensors", "safetensors", header)).comfy_class == "QwenImage"
    model_detection, classes = comfy
    if "MageFlow" not in classes:
        pytest.skip(f"ComfyUI {DEFAULT_VERSION} has no model class MageFlow (it came with a later ComfyUI)")
    meta = {k: torch.empty(s, dtype=SAFETENSORS_DTYPES[d][1], device="meta") for k, (s, d) in tensors.items()}
    assert type(model_detection.model_config_from_unet(meta, "")).__name__ == "QwenImage"
