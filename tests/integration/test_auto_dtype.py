"""A diffusion model loaded with dtype ``auto`` follows ComfyUI's choice for the device Move To GPU puts it on
(``nodes/bridge/auto_dtype.py``), in this process, on the synthetic SD3.5 model and a simulated GPU.

On a machine without a GPU ComfyUI answers float32 for every device (the simulated GPU computes on the CPU), so
these tests have ComfyUI's ``unet_dtype`` answer float16 once the model is loaded: ComfyUI's answer for a GPU that
computes in float16, which is what a move then asks it. The oracle is the same file loaded with an explicit
``fp16``: the moved model must hold its bytes on the GPU, its dtypes, and compute exactly what it computes.
"""

from __future__ import annotations

import gc
import importlib

import pytest
import torch

from tests.integration.simulated import with_simulated_gpu

#: Where the model is when ComfyUI's answer changes: a user's model can be in any of these states.
STATES = ("not loaded", "loaded by ComfyUI", "partly on the GPU", "with a stock LoRA, loaded by ComfyUI")


@pytest.fixture(scope="module")
def comfy(comfy_runtime, synthetic_models):
    from tools.runtime.inprocess import import_comfy, import_pack

    mm = import_comfy()
    path = synthetic_models["sd35"]
    importlib.import_module("folder_paths").add_model_folder_path("diffusion_models", str(path.parent))
    pack = import_pack()
    module = lambda name: importlib.import_module(f"{pack.__name__}.{name}")  # noqa: E731
    lora = importlib.import_module("comfy.utils").load_torch_file(str(synthetic_models["lora_sd35"]))
    yield mm, module, path.name, lora
    mm.unload_all_models()
    gc.collect()


def _load(module, name: str, dtype: str = "auto"):
    return module("nodes.load_diffusion_model").LoadDiffusionModelWithDevice.execute(name, "cpu", dtype).args[0]


def _move(module, model, device: str = "gpu:0", budget: str = "all"):
    return module("nodes.move_to_gpu").MoveToGPU.execute(model, device, budget, False).args


def _step(patcher) -> torch.Tensor:
    importlib.import_module("comfy.model_management").load_models_gpu([patcher])
    torch.manual_seed(3)
    x, context, pooled = torch.randn(1, 16, 8, 8), torch.randn(1, 7, 4096), torch.randn(1, 2048)
    with torch.no_grad():
        return patcher.model.apply_model(x, torch.tensor([500.0]), c_crossattn=context, y=pooled).clone()


def _dtypes(patcher) -> dict[str, torch.dtype]:
    """Every weight's and table's dtype, and ComfyUI 0.28+'s record of it (``<name>_comfy_model_dtype``)."""
    model = patcher.model.diffusion_model
    dtypes = {name: t.dtype for name, t in [*model.named_parameters(), *model.named_buffers()]}
    for path, module in model.named_modules():
        dtypes |= {f"{path}.{k}": v for k, v in vars(module).items() if k.endswith("_comfy_model_dtype")}
    return dtypes


def _lora(patcher, lora: dict, applied: bool):
    return (
        importlib.import_module("comfy.sd").load_lora_for_models(patcher, None, lora, 0.8, 0)[0] if applied else patcher
    )


def _gpu_answers_fp16(mm, monkeypatch) -> None:
    monkeypatch.setattr(mm, "unet_dtype", lambda *args, **kwargs: torch.float16)


def _entry(mm, patcher):
    return next(e for e in mm.current_loaded_models if e.model is patcher)


@pytest.mark.parametrize("state", STATES)
def test_auto_is_stored_as_comfyui_chooses_for_the_gpu_it_moves_to(comfy, monkeypatch, state):
    mm, module, name, lora = comfy
    with_lora = "LoRA" in state
    reference = _lora(_load(module, name, "fp16"), lora, with_lora)  # what ComfyUI's choice for that GPU gives
    expected, fp16_dtypes, fp16_size = _step(reference), _dtypes(reference), reference.model_size()
    del reference
    mm.unload_all_models()
    base = _load(module, name)  # the loader's output, which ComfyUI caches
    ours = _lora(base, lora, with_lora)
    fp32_size = ours.model_size()
    assert set(_dtypes(ours).values()) == {torch.float32} and fp32_size > fp16_size  # auto on the CPU: float32
    sim = with_simulated_gpu(module, monkeypatch, ("nodes.move_to_gpu",))
    if state.endswith("loaded by ComfyUI"):
        mm.load_models_gpu([ours])
    elif state == "partly on the GPU":
        half = _move(module, ours, budget=f"{fp32_size // 2}B")[0]  # ComfyUI still answers float32: no change
        assert 0 < sim.allocated() <= fp32_size // 2 and _dtypes(half) == _dtypes(ours)
    _gpu_answers_fp16(mm, monkeypatch)
    moved, _trigger, summary = _move(module, ours)
    assert _dtypes(moved) == fp16_dtypes
    assert sim.allocated() == fp16_size == moved.model_size() == moved.model.device_control_last_load.resident_bytes
    entry = _entry(mm, moved)
    assert entry.model.loaded_size() == entry.model_memory() == fp16_size  # ComfyUI's books: the fp16 bytes
    assert ours.model_size() == fp16_size  # the input's size, copied once by ComfyUI, corrected too
    assert base.clone().model_size() == fp16_size  # a clone made afterwards (a LoRA loader's, on the next run)
    assert "dtype auto: stored in float16 for gpu:0, computes in float32 (was float32)" in summary, summary
    assert torch.equal(_step(moved), expected)  # exactly the model loaded in float16 (LoRA applied to float16)
    assert torch.equal(_step(ours), expected)  # the input shares the converted weights and still computes
    del base, ours, moved
    mm.unload_all_models()
    gc.collect()


def test_an_explicit_dtype_stays_and_moving_back_to_the_cpu_never_widens(comfy, monkeypatch):
    mm, module, name, _lora_sd = comfy
    sim = with_simulated_gpu(module, monkeypatch, ("nodes.move_to_gpu",))
    explicit = _load(module, name, "fp32")
    size = explicit.model_size()
    _gpu_answers_fp16(mm, monkeypatch)
    moved, _trigger, summary = _move(module, explicit)
    assert set(_dtypes(moved).values()) == {torch.float32} and sim.allocated() == size == moved.model_size()
    assert "dtype auto" not in summary
    del explicit, moved
    mm.unload_all_models()
    expected = _step(_load(module, name, "fp16"))
    mm.unload_all_models()
    auto = _load(module, name)
    on_gpu = _move(module, auto)[0]
    assert set(_dtypes(on_gpu).values()) == {torch.float16} and sim.allocated() == on_gpu.model_size()
    monkeypatch.undo()  # ComfyUI answers float32 for the CPU again
    back, _trigger, summary = _move(module, on_gpu, "cpu")
    assert set(_dtypes(back).values()) == {torch.float16} and sim.allocated() == 0  # float16 kept, in RAM
    assert "dtype auto" not in summary  # nothing to change: float16 already computes in float32 here
    assert torch.equal(_step(back), expected)
    del auto, on_gpu, back
    mm.unload_all_models()
    gc.collect()


def test_a_clone_computing_on_the_cpu_after_the_move_computes_as_comfyui_computes_float16_there(comfy, monkeypatch):
    """Where the GPU computes float16 natively (no manual cast), the converted weights are shared with the input:
    a branch of the graph that computes that input on the CPU must cast them to float32, as ComfyUI computes any
    float16 model on a CPU, not compute in float16 there. Each load sets the compute dtype for its device."""
    mm, module, name, _lora_sd = comfy
    expected = _step(_load(module, name, "fp16"))  # float16 storage computing on the CPU: cast to float32
    mm.unload_all_models()
    ours = _load(module, name)
    sim = with_simulated_gpu(module, monkeypatch, ("nodes.move_to_gpu",))
    _gpu_answers_fp16(mm, monkeypatch)
    native = mm.unet_manual_cast
    monkeypatch.setattr(mm, "unet_manual_cast", lambda *args, **kwargs: None)  # the GPU computes float16 itself
    moved, _trigger, summary = _move(module, ours)
    assert moved.model.manual_cast_dtype is None and sim.allocated() == moved.model_size()
    assert "dtype auto: stored in float16 for gpu:0 (was float32)" in summary, summary
    monkeypatch.setattr(mm, "unet_manual_cast", native)  # ComfyUI's answer for the CPU: float32
    assert torch.equal(_step(ours), expected)  # the input, loaded on the CPU by ComfyUI: float32 compute
    assert ours.model.manual_cast_dtype == torch.float32 and sim.allocated() == 0
    del ours, moved
    mm.unload_all_models()
    gc.collect()


def _casting(patcher) -> tuple[list[bool], list[bool]]:
    """The cast flags of the resident and of the streamed cast layers of ``patcher``'s diffusion model."""
    layers = [m for m in patcher.model.diffusion_model.modules() if hasattr(m, "comfy_cast_weights")]
    streamed = [hasattr(m, "prev_comfy_cast_weights") for m in layers]
    resident = [m.comfy_cast_weights for m, s in zip(layers, streamed, strict=True) if not s]
    return resident, [m.comfy_cast_weights for m, s in zip(layers, streamed, strict=True) if s]


def test_resident_layers_computing_in_their_stored_dtype_skip_the_cast_after_a_cpu_load(comfy, monkeypatch):
    """A load on the CPU casts float16 to float32 (every layer's flag set); loaded again on a GPU that computes
    float16 itself, its resident layers must not go through the cast path at each forward, while its streamed
    layers keep it, across load, offload and load."""
    mm, module, name, _lora_sd = comfy
    ours = _load(module, name)
    with_simulated_gpu(module, monkeypatch, ("nodes.move_to_gpu",))
    _gpu_answers_fp16(mm, monkeypatch)
    native = mm.unet_manual_cast
    monkeypatch.setattr(mm, "unet_manual_cast", lambda *args, **kwargs: None)  # the GPU computes float16 itself
    moved = _move(module, ours)[0]
    monkeypatch.setattr(mm, "unet_manual_cast", native)
    _step(ours)  # the input, on the CPU: float16 cast to float32, every layer casts
    assert ours.model.manual_cast_dtype == torch.float32 and all(_casting(ours)[0])
    monkeypatch.setattr(mm, "unet_manual_cast", lambda *args, **kwargs: None)
    _step(moved)
    resident, streamed = _casting(moved)
    assert resident and not any(resident) and not streamed
    half = _move(module, moved, budget=f"{moved.model_size() // 2}B")[0]
    _step(half)
    resident, streamed = _casting(half)
    assert streamed and all(streamed) and resident and not any(resident)
    mm.unload_all_models()  # offloaded: every layer back in RAM, none casting
    assert not any(_casting(half)[0])
    _step(_move(module, half)[0])
    assert not any(_casting(half)[0])
    del ours, moved, half
    mm.unload_all_models()
    gc.collect()
