"""Models loaded by ComfyUI-GGUF's own loaders, where that pack is installed (it is not on the package index, so it
is never a dependency): ``DEVICE_CONTROL_COMFYUI_GGUF`` names a checkout of it; without one this module skips.

ComfyUI-GGUF keeps each weight in a tensor class of its own; a copy to another device by our transfers loses what
the class carries and the layer then multiplies raw blocks (found here: a shape error at the first step on a
simulated GPU). So Move To GPU and Split Model place a copy of the model's module tree over the same storage, its
weights in our form (``nodes.bridge.foreign``). What holds, on simulated GPUs under budgets: the placed copy
computes what ComfyUI-GGUF's model computes (with a stock LoRA too, which that pack applies its own way), the bytes
are where the placement says, and ComfyUI-GGUF's model is left as it was and computes as before. VRAM Report and
Offload To CPU work on its models as they are (ComfyUI's own unload puts them back).
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

from tests.integration.simulated import with_simulated_gpu, with_simulated_gpus
from tools.fixtures.gguf_files import QWEN3_06B, llama_cpp_name, write_comfyui_gguf, write_gguf, write_qwen3

MiB = 1024**2
CHECKOUT = os.environ.get("DEVICE_CONTROL_COMFYUI_GGUF", "")
pytestmark = pytest.mark.skipif(
    not (Path(CHECKOUT) / "nodes.py").is_file(),
    reason="ComfyUI-GGUF is not installed here: set DEVICE_CONTROL_COMFYUI_GGUF to a checkout of it",
)


#: Wan 2.1 files as ComfyUI-GGUF's tools write them (``tools.fixtures.gguf_files.write_comfyui_gguf``): quantisation ->
#: the plain type of the model converted.
WAN_FILES = {"Q8_0": "F16", "Q4_K_M": "BF16"}


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
def comfy(comfy_runtime, synthetic_models, module_folder):
    from tools.runtime.inprocess import import_comfy, import_pack

    mm = import_comfy()
    folder = module_folder
    unet = write_gguf(synthetic_models["sd35"], folder / "sd35_Q4_0.gguf", "Q4_0", "sd3")
    for quant, plain in WAN_FILES.items():
        write_comfyui_gguf(synthetic_models["wan21"], folder / f"wan21_{quant}.gguf", quant, plain)
    folder_paths = importlib.import_module("folder_paths")
    folder_paths.add_model_folder_path("diffusion_models", str(folder))
    folder_paths.add_model_folder_path("text_encoders", str(folder))
    theirs = _import_comfyui_gguf(Path(CHECKOUT))  # after the folders: it lists .gguf files from theirs
    pack = import_pack()
    module = lambda name: importlib.import_module(f"{pack.__name__}.{name}")  # noqa: E731
    yield mm, module, theirs, unet.name
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


def _their_unet(theirs, unet: str):
    """ComfyUI-GGUF's model of ``unet``, dequantising in float32 (exactly, as ours does; its default dequantises
    Q4_0 in float16, which rounds)."""
    return theirs.UnetLoaderGGUF().load_unet(unet, "float32")[0]


def _blocks(model: torch.nn.Module, module) -> list[torch.Tensor]:
    layout_of = module("core.weights.quantized").layout_of
    return [getattr(m, n) for m in model.modules() for n, _ in m.named_parameters(recurse=False) if layout_of(m, n)]


def test_move_to_gpu_places_our_copy_of_it_and_leaves_theirs_as_it_was(comfy, monkeypatch):
    mm, module, theirs, unet = comfy
    model = _their_unet(theirs, unet)
    expected = _step(mm, model)
    before = _weights(model.model)
    sim = with_simulated_gpu(module, monkeypatch, ("nodes.move_to_gpu",))
    budget = model.model_size() - 4 * MiB  # SD3's positions (a buffer) stay resident: most of this tiny model
    move = module("nodes.move_to_gpu").MoveToGPU
    moved, _trigger, text = move.execute(model, "gpu:0", f"{budget / MiB:.3f}MiB", False).args
    report = moved.model.device_control_last_load
    assert 0 < report.resident_bytes <= budget and report.streamed_bytes > 0, text
    assert 0 < sim.allocated() <= budget + MiB  # the quantised bytes, not dequantised ones
    blocks = _blocks(moved.model, module)
    assert blocks and all(b.dtype == torch.uint8 for b in blocks)
    assert torch.equal(_step(mm, moved), expected)
    again = move.execute(model, "gpu:0", "all", False).args[0]
    assert again.model is moved.model  # the same copy, placed again
    assert torch.equal(_step(mm, again), expected)
    mm.unload_all_models()
    assert _weights(model.model) == before and torch.equal(_step(mm, model), expected)  # theirs, as it was
    del model, moved, again
    mm.unload_all_models()
    gc.collect()


def test_split_model_places_it_over_two_gpus(comfy, monkeypatch):
    mm, module, theirs, unet = comfy
    model = _their_unet(theirs, unet)
    expected = _step(mm, model)
    sims = with_simulated_gpus(module, monkeypatch, ("nodes.split_model",), 2)
    split, _trigger, text = module("nodes.split_model").SplitModel.execute(model, "gpu:0=3MB, gpu:1=*", "pipeline").args
    assert torch.equal(_step(mm, split), expected)
    assert all(sim.allocated() > 0 for sim in sims), (text, [sim.allocated() for sim in sims])
    del model, split
    mm.unload_all_models()
    gc.collect()


def test_with_a_stock_lora_it_computes_what_comfyui_gguf_computes(comfy, synthetic_models, monkeypatch):
    mm, module, theirs, unet = comfy
    comfy_utils, comfy_sd = (importlib.import_module(name) for name in ("comfy.utils", "comfy.sd"))
    lora = comfy_utils.load_torch_file(str(synthetic_models["lora_sd35"]))
    model = comfy_sd.load_lora_for_models(_their_unet(theirs, unet), None, lora, 1.0, 0)[0]
    expected = _step(mm, model)  # ComfyUI-GGUF applies the patches as it dequantises
    sim = with_simulated_gpu(module, monkeypatch, ("nodes.move_to_gpu",))
    budget = model.model_size() - 4 * MiB
    moved = module("nodes.move_to_gpu").MoveToGPU.execute(model, "gpu:0", f"{budget / MiB:.3f}MiB", False).args[0]
    got = _step(mm, moved)
    assert sim.allocated() > 0 and moved.model.device_control_last_load.streamed_bytes > 0
    assert torch.allclose(got, expected, rtol=0, atol=1e-4), (got - expected).abs().max()
    del model, moved
    mm.unload_all_models()
    gc.collect()


def test_from_every_state_their_model_can_be_in_the_copy_starts_from_its_plain_weights(
    comfy, synthetic_models, monkeypatch
):
    """Loaded by ComfyUI with a LoRA (ComfyUI-GGUF writes patched values into its unquantised weights, and keeps
    the rest as patches), or offloaded by Offload To CPU (which keeps our books on the model): the copy is made
    from the weights as the file has them, and carries none of that state."""
    mm, module, theirs, unet = comfy
    comfy_utils, comfy_sd = (importlib.import_module(name) for name in ("comfy.utils", "comfy.sd"))
    plain = _their_unet(theirs, unet)
    expected_plain = _step(mm, plain)
    lora = comfy_utils.load_torch_file(str(synthetic_models["lora_sd35"]))
    with_lora = comfy_sd.load_lora_for_models(plain, None, lora, 1.0, 0)[0]
    expected_lora = _step(mm, with_lora)  # loaded by ComfyUI: the LoRA is in
    assert not torch.equal(expected_lora, expected_plain)
    module("nodes.offload_to_cpu").OffloadToCPU.execute("full", "1GB", True, plain)  # our books on their model
    with_simulated_gpu(module, monkeypatch, ("nodes.move_to_gpu",))
    move = module("nodes.move_to_gpu").MoveToGPU
    mm.load_models_gpu([with_lora])  # loaded again, patched, when the move comes
    moved_lora = move.execute(with_lora, "gpu:0", "all", False).args[0]
    assert torch.allclose(_step(mm, moved_lora), expected_lora, rtol=0, atol=1e-4)  # the LoRA once, not twice
    moved_plain = move.execute(plain, "gpu:0", "all", False).args[0]
    assert torch.equal(_step(mm, moved_plain), expected_plain)  # no LoRA left in the copy's weights
    engine = "_device_control_engine"
    assert moved_plain.model.__dict__.get(engine) is not plain.model.__dict__.get(engine)
    del plain, with_lora, moved_lora, moved_plain
    mm.unload_all_models()
    gc.collect()


def test_a_text_encoder_of_theirs_is_placed_and_encodes_as_before(comfy, monkeypatch, tmp_path):
    """A Qwen3-0.6B (the smallest encoder ComfyUI-GGUF reads correctly that ComfyUI builds: it names a T5's up
    projection ``wi_1`` even where T5-Base has ``wi``), so in ComfyUI 0.28 only."""
    mm, module, theirs, _unet = comfy
    if not hasattr(importlib.import_module("comfy.sd").TEModel, "QWEN3_06B"):
        pytest.skip("this ComfyUI builds no Qwen3-0.6B encoder (0.28 does)")
    source = write_qwen3(tmp_path / "qwen3_06b_synthetic.safetensors")
    rename = llama_cpp_name(gguf.MODEL_ARCH.QWEN3, QWEN3_06B["layers"])
    encoder = write_gguf(source, tmp_path / "qwen3_06b_Q8_0.gguf", "Q8_0", "qwen3", rename)
    importlib.import_module("folder_paths").add_model_folder_path("text_encoders", str(tmp_path))
    monkeypatch.setattr(sys.modules["ComfyUI_GGUF.ops"].GGMLOps.Linear, "dequant_dtype", torch.float32)
    clip = theirs.CLIPLoaderGGUF().load_clip(encoder.name, "stable_diffusion")[0]
    expected = _encode(clip)
    sim = with_simulated_gpu(module, monkeypatch, ("nodes.move_to_gpu",))
    moved = module("nodes.move_to_gpu").MoveToGPU.execute(clip, "gpu:0", "all", False).args[0]
    assert sim.allocated() > 0 and _blocks(moved.cond_stage_model, module)
    assert torch.equal(_encode(moved), expected)
    assert torch.equal(_encode(clip), expected)
    del clip, moved
    mm.unload_all_models()
    gc.collect()


def _encode(clip) -> torch.Tensor:
    with torch.no_grad():
        return clip.encode_from_tokens(clip.tokenize("a red fox in fresh snow")).float().cpu().clone()


def test_vram_report_and_offload_to_cpu_work_on_it_as_it_is(comfy):
    mm, module, theirs, unet = comfy
    model = theirs.UnetLoaderGGUF().load_unet(unet)[0]
    _step(mm, model)
    report = module("nodes.vram_report").VRAMReport.execute("gguf", value=model).args[2]
    subject = json.loads(report)["subject"]
    assert subject["total_bytes"] == model.model_size() > 0 and subject["managed_by"] == "ComfyUI"
    assert subject["resident"] == {"cpu": model.model_size()}
    assert subject["dtype"] == "Q4_0"  # its tensors' GGML type, not the uint8 they hold
    text = module("nodes.offload_to_cpu").OffloadToCPU.execute("full", "1GB", True, model).args[1]
    assert "unloaded from ComfyUI's list" in text
    assert not any(entry.model is model for entry in mm.current_loaded_models)
    del model
    mm.unload_all_models()
    gc.collect()


@pytest.mark.parametrize("quant", list(WAN_FILES))
def test_a_wan_file_of_its_tools_loads_in_ours_as_in_its_loader(comfy, quant):
    """Its tools write Wan's patch embedding as a five-dimensional F32 tensor (``fix_5d_tensors.py``), which GGML's
    own reader refuses: Load Diffusion Model With Device reads it, and builds the weights and the step that
    ComfyUI-GGUF's loader builds from the same file (dequantising in float32)."""
    mm, module, theirs, _unet = comfy
    name = f"wan21_{quant}.gguf"
    model = _their_unet(theirs, name)
    ours = module("nodes.load_diffusion_model").LoadDiffusionModelWithDevice.execute(name, "cpu", "auto").args[0]
    dequantised = _dequantised(model.model.diffusion_model)
    layout_of = module("core.weights.quantized").layout_of
    for path, layer in ours.model.diffusion_model.named_modules():
        for attr, param in layer.named_parameters(recurse=False):
            layout = layout_of(layer, attr)
            value = param if layout is None else layout.decode(param, torch.float32)
            assert torch.equal(value.float(), dequantised[f"{path}.{attr}"]), f"{path}.{attr}"
    torch.manual_seed(3)
    x, context = torch.randn(1, 16, 1, 8, 8), torch.randn(1, 7, 4096)
    steps = []
    for patcher in (model, ours):
        mm.load_models_gpu([patcher])
        with torch.no_grad():
            steps.append(patcher.model.apply_model(x, torch.tensor([500.0]), c_crossattn=context).clone())
    assert torch.equal(*steps)
    subject = json.loads(module("nodes.vram_report").VRAMReport.execute("wan", value=model).args[2])["subject"]
    assert subject["dtype"] == ("Q8_0" if quant == "Q8_0" else "Q4_K/Q6_K blocks, BF16/F32 plain"), subject
    del model, ours
    mm.unload_all_models()
    gc.collect()


def _dequantised(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight of a ComfyUI-GGUF model as its own dequantisation gives it, in float32."""
    dequantize = sys.modules["ComfyUI_GGUF.dequant"].dequantize_tensor
    return {name: dequantize(p, torch.float32, torch.float32).float() for name, p in model.named_parameters()}
