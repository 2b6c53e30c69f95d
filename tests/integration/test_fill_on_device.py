"""Load Checkpoint With Device writing weights straight onto a device, and its fallback to RAM when the device
fills up during the fill (another process took memory after the fit plan), on a simulated GPU in this process.

The simulated GPU takes the fill through the same backend call as CUDA (``DeviceBackend.empty``), so the direct
fill and the product's fallback (``nodes/bridge/checkpoint.py``) run in every CI run; the out-of-memory comes
from the device's own books, injected at a chosen allocation. The node is the real node class, run against the
provisioned ComfyUI; ``test_gpu_paths.py`` has the same fill on a real GPU.
"""

from __future__ import annotations

import importlib

import pytest
import torch

GiB = 1024**3


@pytest.fixture(scope="module")
def pack(comfy_runtime, synthetic_models):
    from tools.runtime.inprocess import import_comfy, import_pack

    mm = import_comfy()
    import folder_paths

    folder_paths.add_model_folder_path("checkpoints", str(synthetic_models["checkpoint"].parent))
    name = import_pack().__name__
    yield mm, lambda module: importlib.import_module(f"{name}.{module}"), synthetic_models["checkpoint"].name
    mm.unload_all_models()


@pytest.fixture
def gpu(pack, monkeypatch):
    """An 8 GiB simulated GPU as the node's gpu:0."""
    mm, module, _ = pack
    sim = module("core.devices.sim.device").SimulatedDevice(8 * GiB)
    inventory = module("core.devices.inventory").DeviceInventory(
        extra=module("core.devices.backends").simulated_backends([sim])
    )
    for user in ("nodes.placing", "nodes.load_checkpoint"):
        monkeypatch.setattr(module(user), "inventory", inventory)
    yield sim
    mm.unload_all_models()
    assert sim.allocated() == 0  # everything given back


def load(pack):
    _, module, name = pack
    node = module("nodes.load_checkpoint").LoadCheckpointWithDevice
    return node.execute(name, "gpu:0", "cpu", "cpu", "fp32", "auto", "auto").args


def model_bytes(model) -> int:
    """The diffusion model's weights and buffers, and its sampling schedule's."""
    return sum(t.numel() * t.element_size() for t in (*model.model.parameters(), *model.model.buffers()))


def test_the_weights_are_written_straight_onto_the_device(pack, gpu):
    model, _clip, _vae, summary = load(pack)
    _, module, _ = pack
    books = module("nodes.bridge.books")
    assert books.resident_on(model, gpu) == model_bytes(model) == gpu.allocated() > 3 * GiB
    report = model.model.device_control_last_load
    assert report.resident_bytes == report.total_bytes and report.moved_in == 0  # nothing was left to move there
    assert "did not fit" not in summary
    first = model.model.diffusion_model.input_blocks[0][0].weight
    assert first.placement_target is gpu and first.abs().sum().item() > 0  # on the device, really filled


@pytest.mark.parametrize("after", [0, 40, 300], ids=["first tensor", "early", "late"])
def test_a_device_that_fills_up_during_the_fill_gets_the_model_in_ram_and_then_what_fits(pack, gpu, after):
    gpu.fail_allocation(after)
    model, _clip, _vae, summary = load(pack)
    _, module, _ = pack
    assert "model: did not fit on sim:0; loaded to RAM" in summary
    books = module("nodes.bridge.books")
    # The tensors filled before the failure were given back; ComfyUI's first load then put the model there.
    assert books.resident_on(model, gpu) == model_bytes(model) == gpu.allocated()
    assert model.model.diffusion_model.input_blocks[0][0].weight.abs().sum().item() > 0
    assert all(torch.isfinite(p).all() for p in model.model.diffusion_model.parameters())


@pytest.mark.parametrize("kind", ["cuda runtime (AcceleratorError)", "hip runtime"])
def test_a_device_whose_runtime_runs_out_of_memory_during_the_fill_gets_the_model_in_ram(pack, gpu, monkeypatch, kind):
    """The fill falls back to RAM when the out-of-memory comes from the device's runtime (a CUDA call under
    memory pressure raises ``torch.AcceleratorError``), not only from its allocator."""
    from tests.core.faults import OUT_OF_MEMORY, fail_moves

    fail_moves(monkeypatch, gpu, OUT_OF_MEMORY[kind], 40)
    model, _clip, _vae, summary = load(pack)
    _, module, _ = pack
    assert "model: did not fit on sim:0; loaded to RAM" in summary
    books = module("nodes.bridge.books")
    assert books.resident_on(model, gpu) == model_bytes(model) == gpu.allocated()
    assert all(torch.isfinite(p).all() for p in model.model.diffusion_model.parameters())
