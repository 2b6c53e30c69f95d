"""The fixture generators on the ComfyUI under test: what they write is what this ComfyUI saves and detects.

The fixtures are made once and cached, possibly by another ComfyUI version; this test builds the layouts again
with the running ComfyUI's own classes and checks the cached files against them and against its detection, so
an API that changed between versions (``state_dict_for_saving`` in 0.28) is caught on every version we test.
"""

from __future__ import annotations

import importlib

import torch
from safetensors import safe_open

from core.detection.headers import SAFETENSORS_DTYPES
from tools.fixtures import make as make_fixtures
from tools.runtime.inprocess import import_comfy


def _on_meta(path) -> dict[str, torch.Tensor]:
    """The file's tensors as meta tensors of the right shape and dtype (no data read)."""
    with safe_open(str(path), "pt") as handle:
        header = {name: handle.get_slice(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
        return {
            name: torch.empty(view.get_shape(), dtype=SAFETENSORS_DTYPES[view.get_dtype()][1], device="meta")
            for name, view in header.items()
        }


def test_the_sd15_checkpoint_is_the_layout_this_comfyui_saves_and_detects(synthetic_models):
    import_comfy()
    detection = importlib.import_module("comfy.model_detection")
    model, clip, vae = make_fixtures.sd15_on_meta()
    layout = make_fixtures.saving_layout(model, clip.state_dict(), vae.state_dict())
    written = _on_meta(synthetic_models["checkpoint"])
    assert set(layout) == set(written)
    assert all(tuple(layout[k].shape) == tuple(written[k].shape) for k in layout)
    assert type(detection.model_config_from_unet(written, "model.diffusion_model.")).__name__ == "SD15"


def test_the_split_files_and_the_sd35_layout_are_detected_by_this_comfyui(synthetic_models):
    import_comfy()
    detection = importlib.import_module("comfy.model_detection")
    unet = detection.model_config_from_unet(_on_meta(synthetic_models["unet"]), "")
    assert type(unet).__name__ == "SD15"
    sd35 = detection.model_config_from_unet(_on_meta(synthetic_models["sd35_tiny"]), "")
    assert type(sd35).__name__ == "SD3"
    assert sd35.unet_config["depth"] == make_fixtures.SD35_TINY_UNET["depth"]
    assert sd35.unet_config["qk_norm"] == "rms"
