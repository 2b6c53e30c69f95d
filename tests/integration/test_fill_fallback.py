"""The loader's out-of-memory fallback while filling weights, on CPU: the device fills up between the fit plan
and the fill (another process took memory), and the model is read into RAM instead, with a note.

On a GPU the out-of-memory comes from the driver (``test_gpu_paths.py`` has the GPU tests); here it comes
from the first fill of each model raising ``torch.OutOfMemoryError`` as the driver would, so the product's own
fallback (``nodes/bridge/checkpoint.py``) runs in every CI run. The node is ComfyUI's real node class, run in
this process against the provisioned ComfyUI.
"""

from __future__ import annotations

import importlib

import pytest
import torch


@pytest.fixture(scope="module")
def loader(comfy_runtime, synthetic_models):
    from tools.comfy_inprocess import import_comfy, import_pack

    mm = import_comfy()
    import folder_paths

    folder_paths.add_model_folder_path("checkpoints", str(synthetic_models["checkpoint"].parent))
    pack = import_pack().__name__
    yield (
        importlib.import_module(f"{pack}.nodes.load_checkpoint").LoadCheckpointWithDevice,
        importlib.import_module(f"{pack}.nodes.bridge.checkpoint"),
        synthetic_models["checkpoint"].name,
    )
    mm.unload_all_models()


def test_a_device_that_fills_up_during_the_fill_gets_the_model_in_ram_with_a_note(loader, monkeypatch):
    node, checkpoint, name = loader
    real = checkpoint.materialize
    failed: list[str] = []

    def full_the_first_time(root, sources, reader, device, **kwargs):
        if not any(root is seen for seen in failed):
            failed.append(root)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return real(root, sources, reader, device, **kwargs)

    monkeypatch.setattr(checkpoint, "materialize", full_the_first_time)
    model, clip, vae, summary = node.execute(name, "cpu", "cpu", "cpu", "fp32", "auto", "auto").args
    assert len(failed) == 3  # the UNet, the text encoder and the VAE each fell back once
    assert summary.count("did not fit on cpu; loaded to RAM") == 3
    weights = [model.model.diffusion_model, clip.cond_stage_model, vae.first_stage_model]
    assert all(p.device.type == "cpu" and not p.is_meta for root in weights for p in root.parameters())
    assert model.model.diffusion_model.input_blocks[0][0].weight.abs().sum().item() > 0  # really filled
