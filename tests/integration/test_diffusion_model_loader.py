"""Load Diffusion Model With Device against ComfyUI's own Load Diffusion Model, in this process: the same model,
tensor for tensor, bit for bit, for a UNet (SD1.5) and a DiT (an SD3.5 layout), in every storage dtype; weights
written straight onto a simulated GPU; and files of other kinds refused before a weight is read.

ComfyUI's ``comfy.sd.load_diffusion_model`` is the oracle, with the ``model_options`` its UNETLoader passes.
"""

from __future__ import annotations

import gc
import importlib

import pytest
import torch

GiB = 1024**3
FILES = {"sd15_unet": "unet", "sd35_tiny": "sd35_tiny"}
#: Our dtype option, and the model_options ComfyUI's UNETLoader passes for it.
DTYPES = {
    "auto": {},
    "fp16": {"dtype": torch.float16},
    "fp8_e4m3fn": {"dtype": torch.float8_e4m3fn},
    "fp8_e4m3fn_fast": {"dtype": torch.float8_e4m3fn, "fp8_optimizations": True},
}


@pytest.fixture(scope="module")
def comfy(comfy_runtime, synthetic_models):
    from tools.runtime.inprocess import import_comfy, import_pack

    mm = import_comfy()
    folder_paths = importlib.import_module("folder_paths")
    for kind in ("unet", "checkpoint", "vae"):  # the other kinds too, as a user may put them there by mistake
        folder_paths.add_model_folder_path("diffusion_models", str(synthetic_models[kind].parent))
    pack = import_pack()
    module = lambda name: importlib.import_module(f"{pack.__name__}.{name}")  # noqa: E731
    yield mm, importlib.import_module("comfy.sd"), module, synthetic_models
    mm.unload_all_models()
    gc.collect()


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("kind", sorted(FILES))
def test_the_same_model_as_comfyuis_load_diffusion_model(comfy, kind, dtype):
    mm, comfy_sd, module, files = comfy
    path = files[FILES[kind]]
    theirs = comfy_sd.load_diffusion_model(str(path), model_options=DTYPES[dtype])
    ours, summary = (
        module("nodes.load_diffusion_model").LoadDiffusionModelWithDevice.execute(path.name, "cpu", dtype).args
    )
    expected, got = _state(theirs.model), _state(ours.model)
    assert set(expected) == set(got)
    for key, tensor in expected.items():
        other = got[key]
        assert (other.dtype, other.device, other.shape) == (tensor.dtype, tensor.device, tensor.shape), key
        assert torch.equal(other, tensor), key
        assert isinstance(other, torch.nn.Parameter) == isinstance(tensor, torch.nn.Parameter), key
    assert ours.model.manual_cast_dtype == theirs.model.manual_cast_dtype
    assert ours.model.model_config.optimizations.get("fp8") == theirs.model.model_config.optimizations.get("fp8")
    assert ours.model_size() == theirs.model_size()
    assert "diffusion model: cpu" in summary
    del theirs, ours
    mm.unload_all_models()
    gc.collect()


def test_the_result_of_a_step_is_comfyuis_bit_for_bit(comfy):
    mm, comfy_sd, module, files = comfy
    path = files["unet"]
    theirs = comfy_sd.load_diffusion_model(str(path))
    ours = module("nodes.load_diffusion_model").LoadDiffusionModelWithDevice.execute(path.name, "cpu", "auto").args[0]
    torch.manual_seed(0)
    latent, cond = torch.randn(1, 4, 8, 8), torch.randn(1, 77, 768)
    timestep = torch.tensor([500.0])
    with torch.no_grad():
        expected = theirs.model.apply_model(latent, timestep, c_crossattn=cond)
        got = ours.model.apply_model(latent, timestep, c_crossattn=cond)
    assert torch.equal(got, expected)
    del theirs, ours
    mm.unload_all_models()
    gc.collect()


def test_the_weights_are_written_straight_onto_a_simulated_gpu(comfy, monkeypatch):
    mm, _comfy_sd, module, files = comfy
    sim = module("core.devices.sim.device").SimulatedDevice(8 * GiB)
    inventory = module("core.devices.inventory").DeviceInventory(
        extra=module("core.devices.backends").simulated_backends([sim])
    )
    for user in ("nodes.placing", "nodes.load_diffusion_model"):
        monkeypatch.setattr(module(user), "inventory", inventory)
    model, summary = (
        module("nodes.load_diffusion_model")
        .LoadDiffusionModelWithDevice.execute(files["unet"].name, "gpu:0", "fp16")
        .args
    )
    report = model.model.device_control_last_load
    assert report.resident_bytes == report.total_bytes == sim.allocated() > GiB
    assert report.moved_in == 0  # filled where it lives: nothing left to move
    assert "diffusion model: gpu:0" in summary and "float16" in summary
    del model
    mm.unload_all_models()
    gc.collect()
    assert sim.allocated() == 0


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        (
            "checkpoint",
            r"is a checkpoint \(Stable Diffusion 1\.5\), not a diffusion model; "
            "load it with Load Checkpoint With Device",
        ),
        ("vae", r"is a vae .*not a diffusion model; load it with Load VAE With Device"),
    ],
)
def test_a_file_of_another_kind_is_refused_naming_what_it_is_and_what_takes_it(comfy, monkeypatch, kind, message):
    _mm, _comfy_sd, module, files = comfy
    reader = module("core.files.reader").WeightReader
    read = []
    monkeypatch.setattr(reader, "read_into", lambda *a, **k: read.append(a))
    error = module("core.errors").DeviceControlError
    with pytest.raises(error, match=message):
        module("nodes.load_diffusion_model").LoadDiffusionModelWithDevice.execute(files[kind].name, "cpu", "auto")
    assert read == []  # refused before any weight was read


def _scaled_fp8_copy(source, target):
    """``source`` stored the way ComfyUI's scaled-fp8 files are: every large matrix in fp8 divided by a per-tensor
    ``scale_weight``, and the ``scaled_fp8`` marker key."""
    from safetensors.torch import load_file, save_file

    tensors = {}
    for key, value in load_file(str(source)).items():
        if key.endswith(".weight") and value.dim() == 2 and value.numel() > 4096:
            scale = value.float().abs().max() / 448.0
            tensors[key] = (value.float() / scale).to(torch.float8_e4m3fn)
            tensors[key.removesuffix("weight") + "scale_weight"] = scale.reshape(())
        else:
            tensors[key] = value
    tensors["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file(tensors, str(target))
    return target


def test_a_scaled_fp8_file_loads_as_comfyui_loads_it_or_is_refused_where_comfyui_quantizes_it(
    comfy, tmp_path, monkeypatch
):
    mm, comfy_sd, module, files = comfy
    importlib.import_module("folder_paths").add_model_folder_path("diffusion_models", str(tmp_path))
    path = _scaled_fp8_copy(files["sd35_tiny"], tmp_path / "sd35_scaled_fp8.safetensors")
    node = module("nodes.load_diffusion_model").LoadDiffusionModelWithDevice
    if module("nodes.model_files").quantizes_scaled_fp8():  # ComfyUI 0.2x: quantized layers, built while reading
        read = []
        monkeypatch.setattr(module("core.files.reader").WeightReader, "read_into", lambda *a, **k: read.append(a))
        with pytest.raises(module("core.errors").DeviceControlError, match="stores its layers in fp8 with scales"):
            node.execute(path.name, "cpu", "auto")
        assert read == []
        return
    theirs = comfy_sd.load_diffusion_model(str(path))
    ours = node.execute(path.name, "cpu", "auto").args[0]
    expected, got = _state(theirs.model), _state(ours.model)
    assert set(expected) == set(got) and any(key.endswith("scale_weight") for key in got)
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    torch.manual_seed(0)
    latent, context, pooled = torch.randn(1, 16, 8, 8), torch.randn(1, 77, 768), torch.randn(1, 768)
    with torch.no_grad():
        expected = theirs.model.apply_model(latent, torch.tensor([500.0]), c_crossattn=context, y=pooled)
        got = ours.model.apply_model(latent, torch.tensor([500.0]), c_crossattn=context, y=pooled)
    assert torch.equal(got, expected)
    del theirs, ours
    mm.unload_all_models()
    gc.collect()


def _builds_nothing(surface, layout) -> bool:
    """Whether the running ComfyUI lacks the layout's class and its own detection takes the file for no older one.

    An older ComfyUI may take a newer family for one it has (0.28 takes Mage-Flow for Qwen-Image, whose detection
    it shares): such a file is built as ComfyUI builds it, by design, so it is no case of "update ComfyUI".
    """
    from core.detection.headers import SAFETENSORS_DTYPES

    if surface.has_model_class(layout["comfy_detected"]):
        return False
    meta = {
        k: torch.empty(shape, dtype=SAFETENSORS_DTYPES[dtype][1], device="meta")
        for k, (shape, dtype) in layout["tensors"].items()
    }
    try:
        return surface.model_detection().model_config_from_unet(meta, "") is None
    except Exception:  # ComfyUI's detection failing on a file it half-recognises: it builds nothing either
        return True


def test_a_family_this_comfyui_cannot_build_is_refused_before_reading_saying_to_update(comfy, tmp_path, monkeypatch):
    _mm, _comfy_sd, module, _files = comfy
    from tools.fixtures.layouts import new_layouts, write_sparse_safetensors

    surface = module("nodes.surface")
    newer = next((layout for layout in new_layouts().values() if _builds_nothing(surface, layout)), None)
    if newer is None:
        pytest.skip("this ComfyUI builds every family of the layouts generated from the newest ComfyUI tested")
    importlib.import_module("folder_paths").add_model_folder_path("diffusion_models", str(tmp_path))
    path = write_sparse_safetensors(newer, tmp_path / "newer_family.safetensors")
    read = []
    monkeypatch.setattr(module("core.files.reader").WeightReader, "read_into", lambda *a, **k: read.append(a))
    with pytest.raises(module("core.errors").DeviceControlError, match=r"update ComfyUI"):
        module("nodes.load_diffusion_model").LoadDiffusionModelWithDevice.execute(path.name, "cpu", "auto")
    assert read == []
