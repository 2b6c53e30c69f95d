"""ComfyUI's own detection as the oracle: on the same layouts, it names the same class as ours.

The layouts in tests/data carry ComfyUI 0.3.75's labels; this test asks the running ComfyUI again, so a
ComfyUI that detects differently (another version) is caught here rather than in users' hands.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from core.detection.detect import detect_header
from core.detection.family_table import FAMILIES
from core.detection.headers import SAFETENSORS_DTYPES, FileHeader, TensorInfo
from tools.fixtures.layouts import layouts
from tools.runtime.provision import DEFAULT_VERSION

#: How many model classes each tested ComfyUI builds (``comfy.supported_models.models``): the counts users read.
MODEL_CLASSES = {"0.3.52": 54, "0.3.75": 65, "0.28.0": 96, "0.33.0": 100}

CHECKPOINTS = sorted(name for name, layout in layouts().items() if layout["kind"] == "checkpoint")


@pytest.fixture(scope="module")
def model_detection(comfy_runtime):
    from tools.runtime.inprocess import import_comfy

    import_comfy()
    return importlib.import_module("comfy.model_detection")


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_comfyui_detects_the_class_we_detect(model_detection, name):
    layout = layouts()[name]
    meta = {
        k: torch.empty(shape, dtype=SAFETENSORS_DTYPES[dtype][1], device="meta")
        for k, (shape, dtype) in layout["tensors"].items()
    }
    prefix = model_detection.unet_prefix_from_state_dict(meta)
    config = model_detection.model_config_from_unet(meta, prefix)
    tensors = {k: TensorInfo(k, dtype, tuple(shape)) for k, (shape, dtype) in layout["tensors"].items()}
    ours = detect_header(FileHeader(name, "safetensors", tensors))
    assert type(config).__name__ == ours.comfy_class
    assert prefix == ours.prefix


def test_the_family_table_knows_every_model_class_the_running_comfyui_builds(model_detection):
    """Against ``comfy.supported_models`` of the ComfyUI under test, not against itself: a class ComfyUI builds
    that the table lacks is named here (such a file still loads, through ComfyUI's own detection)."""
    supported = importlib.import_module("comfy.supported_models")
    theirs = {cls.__name__ for cls in supported.models}
    assert len(supported.models) == len(theirs) == MODEL_CLASSES[DEFAULT_VERSION]
    ours = {family.comfy_class for family in FAMILIES}
    missing = sorted(theirs - ours)
    assert not missing, f"the family table lacks {len(missing)} of ComfyUI's classes: {', '.join(missing)}"
    # Ours may know classes this ComfyUI does not have yet (the table follows the newest ComfyUI tested).
    assert len(ours) == len(FAMILIES) and ours >= theirs
