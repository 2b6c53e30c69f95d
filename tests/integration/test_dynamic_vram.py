"""ComfyUI's Dynamic VRAM patcher (``ModelPatcherDynamic``, ComfyUI 0.16 and later), the real class, in process.

On an NVIDIA GPU with comfy-aimdo, ComfyUI's loaders build every model with ``ModelPatcherDynamic``, which moves
weights itself, layer by layer, while sampling. Move To GPU places such a model through the classic copy ComfyUI
builds of it (``get_non_dynamic_delegate``, or ``clone(disable_dynamic=True)``: the file read again by the
loader that made it). Without a GPU the class cannot be built as ComfyUI builds it: its constructor sends a CPU
model to the classic patcher (checked here), and for another device it allocates aimdo's pinned host buffers,
a native library that needs the NVIDIA driver. So these tests build the real class for the device ``cuda:0``
with that one step replaced by empty pin books (what the constructor records before anything is pinned), and
never load it: everything else (``is_dynamic``, ``clone``, ``get_non_dynamic_delegate``, the loader that
rebuilds the model) is ComfyUI's own code. What stays unverified without a GPU: aimdo's own loading of the
dynamic model (its pinning, its per-layer moves), and a dynamic and a placed copy of one model sharing VRAM.
"""

from __future__ import annotations

import gc
import importlib

import pytest
import torch

GiB = 1024**3
CPU = torch.device("cpu")
GPU = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def comfy(comfy_runtime, synthetic_models):
    from tools.runtime.inprocess import import_comfy, import_pack

    mm = import_comfy()
    patchers = importlib.import_module("comfy.model_patcher")
    if not hasattr(patchers, "ModelPatcherDynamic"):
        pytest.skip("this ComfyUI has no Dynamic VRAM (ModelPatcherDynamic came with ComfyUI 0.16)")
    pack = import_pack()
    modules = {
        name: importlib.import_module(f"{pack.__name__}.{name}")
        for name in ("nodes.bridge.moves", "nodes.bridge.books", "nodes.bridge.reading", "nodes.bridge.dynamic_vram")
    }
    modules["inventory"] = importlib.import_module(f"{pack.__name__}.core.devices.inventory")
    modules["simulated"] = importlib.import_module(f"{pack.__name__}.core.devices.sim.device")
    modules["backends"] = importlib.import_module(f"{pack.__name__}.core.devices.backends")
    yield mm, patchers, modules, synthetic_models
    mm.unload_all_models()


def dynamic_model(patchers, path: str):
    """ComfyUI's loader's model under a real ``ModelPatcherDynamic`` for ``cuda:0``, as its loaders leave it
    (``cached_patcher_init`` names the loader that rebuilds it), with empty pin books instead of aimdo's."""
    import comfy.sd

    classic = comfy.sd.load_diffusion_model(path)
    patcher = dynamic_over(patchers, classic.model, classic.model_size())
    patcher.cached_patcher_init = (comfy.sd.load_diffusion_model, (path, {}))
    return patcher


def dynamic_over(patchers, model: torch.nn.Module, size: int):
    """A real ``ModelPatcherDynamic`` for ``cuda:0`` over ``model``, with empty pin books instead of aimdo's, and no
    way to rebuild it recorded (as ComfyUI's loaders other than the checkpoint's, the diffusion model's and the
    text encoders' leave it)."""
    cls = patchers.ModelPatcherDynamic
    patcher = cls.__new__(cls, model, GPU, CPU)
    assert type(patcher) is cls  # for a GPU, ComfyUI's constructor keeps the dynamic class
    model.dynamic_vbars = {}
    empty = (None, [], [-1], [0], [0], {})  # aimdo's host buffer, stack, split, pinned size, ...: nothing pinned
    model.dynamic_pins = {
        GPU: {"weights": empty, "patches": empty, "hostbufs_initialized": False, "failed": False, "active": False}
    }
    patchers.ModelPatcher.__init__(patcher, model, GPU, CPU, size)
    patcher.non_dynamic_delegate_model = None
    patcher.cached_patcher_init = None
    return patcher


def forward(patcher) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 8, 8, generator=generator)
    context = torch.randn(1, 77, 768, generator=generator)
    with torch.no_grad():
        out = patcher.model.apply_model(x, torch.tensor([0.5]), c_crossattn=context)
    return out.as_subclass(torch.Tensor).clone()


def test_comfyui_builds_a_cpu_model_with_the_classic_patcher(comfy):
    _mm, patchers, _modules, _files = comfy
    model = torch.nn.Linear(4, 4)
    built = patchers.ModelPatcherDynamic(model, CPU, CPU)
    assert type(built) is patchers.ModelPatcher and not built.is_dynamic()


def test_a_dynamic_model_is_placed_through_its_classic_copy(comfy):
    mm, patchers, modules, files = comfy
    dynamic = dynamic_model(patchers, str(files["unet"]))
    assert dynamic.is_dynamic() and modules["nodes.bridge.dynamic_vram"].is_dynamic(dynamic)
    expected = forward(dynamic)  # the dynamic model's own weights, as loaded (in RAM)
    sim = modules["simulated"].SimulatedDevice(8 * GiB)
    inventory = modules["inventory"].DeviceInventory(extra=modules["backends"].simulated_backends([sim]))
    reading, books = modules["nodes.bridge.reading"], modules["nodes.bridge.books"]
    assert reading.residency_of(dynamic, inventory.snapshot()).managed_by == "ComfyUI Dynamic VRAM"

    moved = modules["nodes.bridge.moves"].move(dynamic, "gpu:0", "1GB", False, inventory)
    placed = moved.value
    assert type(placed).__name__ == "DeviceControlPatcher" and not placed.is_dynamic()
    assert placed.model is not dynamic.model  # ComfyUI's loader built the classic copy from the file
    resident = books.resident_on(placed, sim)
    assert 0 < resident <= GiB and sim.allocated() == resident
    assert moves_note(modules) in moved.text and "resident on gpu:0" in moved.text
    described = reading.residency_of(placed, inventory.snapshot())
    assert described.managed_by == "Device Control" and described.budget == "1.00 GiB"
    sim.reset_peak()
    torch.testing.assert_close(forward(placed), expected, rtol=0, atol=0)
    assert sim.peak_allocated() > resident  # it computed on the simulated GPU

    # A second move reuses the classic copy ComfyUI keeps on the dynamic patcher: the file is not read again.
    delegate = dynamic.non_dynamic_delegate_model
    assert delegate is not None and delegate[0] is placed.model
    again = modules["nodes.bridge.moves"].move(dynamic, "gpu:0", "512MB", False, inventory).value
    assert again.model is placed.model and books.resident_on(again, sim) <= 512 * 1024**2
    mm.unload_all_models()
    assert sim.allocated() == 0
    del dynamic, placed, again, moved
    gc.collect()


def moves_note(modules) -> str:
    return modules["nodes.bridge.moves"].DYNAMIC_NOTE


def test_a_dynamic_controlnet_is_refused_with_the_fix_comfyui_leaves_before_anything_moves(comfy):
    # Under Dynamic VRAM ComfyUI builds a ControlNet's patcher dynamic too, and records no way to rebuild it.
    mm, patchers, modules, files = comfy
    control = importlib.import_module("comfy.controlnet").load_controlnet(str(files["controlnet"]))
    classic = control.control_model_wrapped
    control.control_model_wrapped = dynamic_over(patchers, classic.model, classic.model_size())
    sim = modules["simulated"].SimulatedDevice(8 * GiB)
    inventory = modules["inventory"].DeviceInventory(extra=modules["backends"].simulated_backends([sim]))
    with pytest.raises(Exception, match="ComfyUI's loader of a ControlNet records no way to rebuild it") as refused:
        modules["nodes.bridge.moves"].move(control, "gpu:0", "all", False, inventory)
    assert type(refused.value).__name__ == "DeviceControlError"
    assert "--disable-dynamic-vram" in str(refused.value) and "Load Checkpoint" not in str(refused.value)
    assert sim.allocated() == 0  # nothing moved
    mm.unload_all_models()


def test_a_controlnet_our_loader_builds_under_dynamic_vram_is_classic_and_placed(comfy):
    # Load ControlNet With Device calls ComfyUI's loader inside classic_builds: where ComfyUI's main.py made its
    # core patcher the dynamic one, the ControlNet still comes out classic, and Move To GPU's engine places it.
    mm, patchers, modules, files = comfy
    dynamic_vram = modules["nodes.bridge.dynamic_vram"]
    original = patchers.CoreModelPatcher
    patchers.CoreModelPatcher = patchers.ModelPatcherDynamic  # what main.py sets under Dynamic VRAM
    try:
        with dynamic_vram.classic_builds():
            control = importlib.import_module("comfy.controlnet").load_controlnet(str(files["controlnet"]))
        assert patchers.CoreModelPatcher is patchers.ModelPatcherDynamic  # set back at once
    finally:
        patchers.CoreModelPatcher = original
    assert type(control.control_model_wrapped) is patchers.ModelPatcher
    sim = modules["simulated"].SimulatedDevice(8 * GiB)
    inventory = modules["inventory"].DeviceInventory(extra=modules["backends"].simulated_backends([sim]))
    moved = modules["nodes.bridge.moves"].move(control, "gpu:0", "all", False, inventory).value
    size = moved.control_model_wrapped.model_size()
    assert size > 100 * 1024**2 and sim.allocated() >= size  # the whole ControlNet on the simulated GPU
    mm.unload_all_models()
