"""Move To GPU taking a model over from the state ComfyUI's own low-VRAM loader leaves, in this process.

On a GPU too small for a model, ComfyUI's ``load_models_gpu`` loads it partially: ``LoadedModel.model_load``
with the VRAM it found free, which keeps some layers on the device, marks the others to be cast on the fly
and gives their patches (LoRAs) to ``LowVramPatch`` weight functions. A machine without a GPU never computes
such a figure (ComfyUI's CPU mode loads everything), so these tests make that very call with a budget
themselves, on ComfyUI's own classes and models (the SD1.5 UNet and the SD3.5-layout DiT from the synthetic
files, loaded by ComfyUI's own ``load_diffusion_model``), then move the model with Device Control onto a
simulated GPU and check the bytes there, ComfyUI's books and the result against ComfyUI's own full load.
"""

from __future__ import annotations

import gc
import importlib

import pytest
import torch

from tests.host_math import same_result

MiB = 1024**2
GiB = 1024**3


@pytest.fixture(scope="module")
def comfy(comfy_runtime, synthetic_models):
    from tools.runtime.inprocess import import_comfy, import_pack

    mm = import_comfy()
    pack = import_pack()
    modules = {
        name: importlib.import_module(f"{pack.__name__}.{name}")
        for name in (
            "nodes.bridge.moves",
            "nodes.bridge.books",
            "nodes.bridge.patcher",
            "nodes.bridge.reading",
            "core.devices.backends",
            "core.devices.inventory",
            "core.devices.sim.device",
            "core.errors",
        )
    }
    yield mm, modules, synthetic_models
    mm.unload_all_models()


#: The synthetic diffusion models: their file, latent channels, whether they take a pooled vector (``y``), and a
#: budget smaller than each.
MODELS = {"sd15_unet": ("unet", 4, False, GiB), "sd35_tiny": ("sd35_tiny", 16, True, 50 * MiB)}


def load_stock(comfy, kind: str):
    """ComfyUI's own loader's patcher for a synthetic file, with a patch (a diff) on a few weights."""
    _mm, _modules, files = comfy
    import comfy.sd

    patcher = comfy.sd.load_diffusion_model(str(files[MODELS[kind][0]]))
    keys = [k for k, v in patcher.model.state_dict().items() if v.dim() == 2 and k.endswith(".weight")]
    generator = torch.Generator().manual_seed(0)
    patches = {}
    for key in keys[:: max(1, len(keys) // 12)]:
        shape = patcher.model.state_dict()[key].shape
        patches[key] = (torch.randn(shape, generator=generator) * 0.01,)
    patcher.add_patches(patches, 1.0)
    return patcher


def forward(patcher, kind: str) -> torch.Tensor:
    """One denoising call of the model, as a sampler makes it, on fixed inputs."""
    _file, channels, pooled, _budget = MODELS[kind]
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, channels, 8, 8, generator=generator)
    context = torch.randn(1, 77, 768, generator=generator)
    extra = {"y": torch.randn(1, 768, generator=generator)} if pooled else {}
    with torch.no_grad():
        out = patcher.model.apply_model(x, torch.tensor([0.5]), c_crossattn=context, **extra)
    return out.as_subclass(torch.Tensor).clone()


def comfy_low_vram_load(mm, patcher, budget: int):
    """What ``load_models_gpu`` does for a model on a GPU with ``budget`` bytes free: ComfyUI's own partial load,
    and the model first in ComfyUI's list."""
    loaded = mm.LoadedModel(patcher)
    loaded.model_load(lowvram_model_memory=budget)
    mm.current_loaded_models.insert(0, loaded)


def entries_of(mm, model) -> list:
    return [e for e in mm.current_loaded_models if e.model is not None and e.model.model is model]


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_model_comfyui_loaded_in_low_vram_mode_is_taken_over_exactly(comfy, kind):
    mm, modules, _files = comfy
    budget = MODELS[kind][3]
    sim = modules["core.devices.sim.device"].SimulatedDevice(8 * GiB)
    inventory = modules["core.devices.inventory"].DeviceInventory(
        extra=modules["core.devices.backends"].simulated_backends([sim])
    )
    patcher = load_stock(comfy, kind)
    mm.load_models_gpu([patcher])  # ComfyUI's full load (patches applied to every weight): the oracle
    expected = forward(patcher, kind)
    mm.unload_all_models()

    comfy_low_vram_load(mm, patcher, budget // 2)
    model = patcher.model
    streamed = [m for m in model.modules() if hasattr(m, "prev_comfy_cast_weights")]
    assert model.model_lowvram and streamed, "ComfyUI did not load the model partially; the test starts nowhere"
    assert any(type(f).__name__ == "LowVramPatch" for m in streamed for f in getattr(m, "weight_function", []))

    moved = modules["nodes.bridge.moves"].move(patcher, "gpu:0", f"{budget}", False, inventory)
    clone = moved.value
    books = modules["nodes.bridge.books"]
    assert books.in_force(clone)
    resident = books.resident_on(clone, sim)
    assert 0 < resident <= budget and sim.allocated() == resident
    assert "before:" in moved.text and "loaded by ComfyUI" in moved.text and "resident on gpu:0" in moved.text
    listed = entries_of(mm, model)
    assert [e.model for e in listed] == [clone], "ComfyUI still lists the model as ComfyUI loaded it"
    assert clone.loaded_size() == resident and model.model_lowvram
    assert not any(
        type(f).__name__ == "LowVramPatch" for m in model.modules() for f in getattr(m, "weight_function", [])
    )

    mm.load_models_gpu([clone])  # what the next sampler does: nothing moves
    assert books.resident_on(clone, sim) == resident == sim.allocated()
    sim.reset_peak()
    result = forward(clone, kind)
    assert sim.peak_allocated() > resident  # it computed on the simulated GPU
    clone.cleanup()  # as every sampler does when it ends: the streaming ring's slots go
    # What stays beside the resident weights: the streamed layers' patches, which crossed once when they first
    # computed and stay for the next steps (the plan keeps room for them), inside the budget.
    assert resident <= sim.allocated() <= budget
    assert same_result(result, expected)  # ComfyUI's own result, bit for bit where slices are exact here

    # Another branch of the graph samples with the loader's own patcher: ComfyUI takes the weights back its way.
    displaced = books.displacements()
    mm.load_models_gpu([patcher])
    assert sim.allocated() == 0 and not books.in_force(clone)
    assert books.displacements() > displaced  # so Move To GPU runs again, at its point of the graph
    described = modules["nodes.bridge.reading"].residency_of(clone, inventory.snapshot())
    assert described.managed_by == "ComfyUI" and described.budget is None and "not in force now" in described.note
    torch.testing.assert_close(forward(patcher, kind), expected, rtol=0, atol=0)

    mm.unload_all_models()
    assert sim.allocated() == 0
    del patcher, clone, moved, model
    gc.collect()


def test_a_load_that_does_not_go_through_device_control_is_an_error_not_a_success(comfy, monkeypatch):
    """Another pack replacing the patcher's loading (as multi-GPU packs replace ComfyUI's functions) leaves the
    model where ComfyUI put it: Move To GPU says so and fails, and the model still works where it is."""
    mm, modules, _files = comfy
    sim = modules["core.devices.sim.device"].SimulatedDevice(8 * GiB)
    inventory = modules["core.devices.inventory"].DeviceInventory(
        extra=modules["core.devices.backends"].simulated_backends([sim])
    )
    patcher = load_stock(comfy, "sd35_tiny")
    mm.load_models_gpu([patcher])
    expected = forward(patcher, "sd35_tiny")
    plain = type(patcher).partially_load  # ComfyUI's own: it keeps a model that looks loaded as it is
    monkeypatch.setattr(modules["nodes.bridge.patcher"].DeviceControlPatcher, "partially_load", plain)
    errors = modules["core.errors"]
    with pytest.raises(errors.DeviceControlError, match=r"could not place .* on gpu:0.*on cpu, loaded by ComfyUI"):
        modules["nodes.bridge.moves"].move(patcher, "gpu:0", "50MB", False, inventory)
    assert sim.allocated() == 0
    monkeypatch.undo()
    torch.testing.assert_close(forward(patcher, "sd35_tiny"), expected, rtol=0, atol=0)
    mm.unload_all_models()
