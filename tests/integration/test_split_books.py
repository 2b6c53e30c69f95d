"""ComfyUI's books for a model split over GPUs that ComfyUI manages, in this process, with ComfyUI's own
``load_models_gpu``, ``free_memory`` and clean-up: the part on the second GPU has an entry of its own in
``current_loaded_models``, so ComfyUI making room on that GPU for another model unloads the split (every device,
patched weights restored), the next sampler neither reloads nor books it twice, and nothing is left listed when the
model is offloaded or freed.

No machine here has a GPU. The simulated GPUs are the host to ComfyUI (it makes no room on them: the pack does,
tested with the node); so the second GPU here is a simulated GPU whose backend, a subclass of the simulated one,
says what a CUDA backend says: ComfyUI manages it, as ``mps:1`` (a device ComfyUI reads free memory of from the
host without a GPU). Everything else is the pack's code and ComfyUI's.
"""

from __future__ import annotations

import gc
import importlib
import uuid
from typing import Any

import pytest
import torch

ALLOCATION = "gpu:0=50%, gpu:1=*"
SECOND = torch.device("mps", 1)


@pytest.fixture(scope="module")
def comfy(comfy_runtime, synthetic_models):
    from tools.runtime.inprocess import import_comfy, import_pack

    mm = import_comfy()
    pack = import_pack()
    yield mm, lambda name: importlib.import_module(f"{pack.__name__}.{name}")
    mm.unload_all_models()
    gc.collect()


@pytest.fixture
def gpus(comfy, monkeypatch):
    """A simulated GPU ComfyUI sees as the host (gpu:0) and one it manages as ``mps:1`` (gpu:1)."""
    mm, module = comfy
    simulated, backends = module("core.devices.sim.device"), module("core.devices.backends")

    class ManagedDevice(simulated.SimulatedDevice):
        """A simulated GPU that ComfyUI knows as a device of its own."""

    class ManagedBackend(backends.SimulatedBackend):
        comfy_makes_room = True

        def comfy_device(self, target: Any) -> torch.device:
            return torch.device("mps", target.ordinal)

    monkeypatch.setitem(backends._BY_CLASS, ManagedDevice, ManagedBackend())
    yield simulated.SimulatedDevice(1 << 32, ordinal=0), ManagedDevice(1 << 32, ordinal=1)
    mm.unload_all_models()
    mm.current_loaded_models.clear()
    gc.collect()


def _split_clone(module: Any, path: Any, gpus: tuple[Any, Any]) -> Any:
    """SD1.5's UNet from ComfyUI's loader, cloned as the node clones it, carrying a pipeline split over ``gpus``."""
    comfy_sd = importlib.import_module("comfy.sd")
    base = module("nodes.bridge.patcher").adopt(comfy_sd.load_diffusion_model(str(path)), None)
    splits = module("nodes.bridge.splits")
    allocation = module("core.placement.allocation").parse_allocation(ALLOCATION)
    placement = splits.SplitPlacement(allocation, "pipeline", (("gpu:0", gpus[0]), ("gpu:1", gpus[1])), ALLOCATION)
    clone = base.clone()
    clone.device_control_split = placement
    clone.patches_uuid = uuid.uuid4()
    clone.load_device = torch.device("cpu")  # what ComfyUI calls the first (simulated) GPU
    return clone


def _neighbour() -> Any:
    """A model ComfyUI loads onto the second GPU that wants more room than there is (it has no weights)."""
    return importlib.import_module("comfy.model_patcher").ModelPatcher(
        torch.nn.Module(), SECOND, torch.device("cpu"), size=1 << 50
    )


def _on(mm: Any, device: torch.device) -> list[Any]:
    return [entry for entry in mm.current_loaded_models if entry.device == device]


def test_comfyui_making_room_on_the_second_gpu_unloads_the_split_and_restores_patched_weights(
    comfy, gpus, synthetic_models
):
    mm, module = comfy
    split_of = module("core.placement.split_model").split_of
    books = module("nodes.bridge.books")
    clone = _split_clone(module, synthetic_models["unet"], gpus)
    plan = module("core.placement.split_model").plan_split(
        module("nodes.bridge.splits").request_of(clone, clone.device_control_split)
    )
    key = f"{plan.parts[1].blocks[-1].layers[0].name}.weight"
    original = clone.model.state_dict()[key].clone()
    clone.add_patches({key: (torch.full_like(original, 0.25),)})

    mm.load_models_gpu([clone])
    held = split_of(clone.model)
    on_second = held.resident_bytes(gpus[1])
    assert held is not None and on_second > 0 and gpus[1].allocated() == on_second
    assert [e.model for e in _on(mm, torch.device("cpu"))] == [clone]
    (part,) = _on(mm, SECOND)
    assert part.model_loaded_memory() == part.model_memory() == on_second
    assert [e.model for e in books.entries()] == [clone], "the pack's books count the split once"
    assert mm.loaded_models(only_currently_used=True) == [clone], "a part is never loaded on its own"
    assert torch.equal(clone.model.state_dict()[key].cpu(), original + 0.25)

    mm.load_models_gpu([clone])  # the next sampler: nothing moves, nothing is booked twice
    assert split_of(clone.model) is held and len(_on(mm, SECOND)) == 1
    # One load of the split model and of a model on the second GPU that wants all of it: ComfyUI makes room there
    # while the split is being loaded, which keeps its part (it would be split again at once).
    mm.load_models_gpu([clone, _neighbour()])
    assert split_of(clone.model) is held and gpus[1].allocated() == on_second

    mm.free_memory(1e30, SECOND)  # ComfyUI makes room on the second GPU for another model
    assert gpus[0].allocated() == 0 and gpus[1].allocated() == 0 and split_of(clone.model) is None
    assert clone.loaded_size() == 0 and not _on(mm, SECOND)
    assert torch.equal(clone.model.state_dict()[key], original), "the patched weight was not restored"

    mm.load_models_gpu([clone])  # the next sampler splits it again, and books the part again
    assert split_of(clone.model) is not None and gpus[1].allocated() == on_second
    assert [e.model_loaded_memory() for e in _on(mm, SECOND)] == [on_second]

    mm.free_memory(1e30, torch.device("cpu"))  # ComfyUI unloads the model's own entry: every device is freed
    assert gpus[1].allocated() == 0 and [(e.model_loaded_memory(), e.model_memory()) for e in _on(mm, SECOND)] == [
        (0, 0)
    ], "a part of an ended split holds and asks for nothing"
    mm.load_models_gpu([clone])  # the part that held nothing gives way to the new split's
    assert [e.model_loaded_memory() for e in _on(mm, SECOND)] == [on_second]


def test_offload_and_freeing_the_model_leave_no_entry_of_a_split_behind(comfy, gpus, synthetic_models):
    mm, module = comfy
    books = module("nodes.bridge.books")
    clone = _split_clone(module, synthetic_models["unet"], gpus)
    mm.load_models_gpu([clone])
    assert len(_on(mm, SECOND)) == 1

    books.unload_entries(books.clone_entries(clone))  # Offload To CPU (full) and the panel's Offload
    assert gpus[0].allocated() == 0 and gpus[1].allocated() == 0
    assert not mm.current_loaded_models, "an entry of the offloaded split is still listed"

    mm.load_models_gpu([clone])
    assert len(_on(mm, SECOND)) == 1 and gpus[1].allocated() > 0
    whole = clone.clone()  # the same model on one device (ComfyUI's choice here: RAM) ends the split
    whole.device_control_split = None
    mm.load_models_gpu([whole])
    assert gpus[0].allocated() == 0 and gpus[1].allocated() == 0 and not _on(mm, SECOND)

    mm.load_models_gpu([clone])
    assert len(_on(mm, SECOND)) == 1 and gpus[1].allocated() > 0
    del clone, whole
    gc.collect()  # the model is gone: ComfyUI's clean-up takes its entries, the part's with it
    mm.cleanup_models_gc()
    assert all(entry.model is not None for entry in mm.current_loaded_models)
    assert not _on(mm, SECOND)
