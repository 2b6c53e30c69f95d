"""Load Text Encoders With Device and Load VAE With Device against ComfyUI's own loaders, in this process: the same
objects, tensor for tensor, bit for bit, in every storage dtype; weights written straight onto a simulated GPU;
and files of other kinds, types that do not take the files and dtypes a VAE cannot have, refused before a weight
is read.

ComfyUI's ``comfy.sd.load_clip`` (what its CLIP loaders call, with the ``model_options`` a dtype means) and
``comfy.sd.VAE`` (what its Load VAE builds) are the oracles. The CLIP-L and VAE files are the synthetic SD1.5
split files (random weights). T5-XXL is too big to generate: its test uses the released layout written sparsely
(a header and a hole, read back as zeros), so only names, shapes, dtypes and classes are compared, and only on the
primary ComfyUI (0.3.75), in fp8 (two copies of 4.7 billion parameters must fit beside each other).
"""

from __future__ import annotations

import gc
import hashlib
import importlib
import weakref

import pytest
import torch

from tests.integration.simulated import with_simulated_gpu
from tests.passes import PRIMARY_PASS
from tests.server_pool import wait_for_ram
from tools.fixtures.layouts import layouts, write_sparse_safetensors
from tools.fixtures.make import SD15_CHECKPOINT, SD15_CLIP_L, SD15_UNET, SD15_VAE

DTYPES = {"auto": {}, "fp16": {"dtype": torch.float16}, "fp8_e4m3fn": {"dtype": torch.float8_e4m3fn}}
#: A weight ComfyUI leaves uninitialised when the file lacks it (CLIP-L's projection, unused for conditioning).
UNINITIALISED = "text_projection.weight"
#: Two full-size T5-XXL in this process at once (ComfyUI's and ours, 9.1 GiB): no other tier's module holds models
#: meanwhile (``tests/server_pool.machine_ram``).
HOLDS_MODELS = True
#: The three optional text-encoder files, unused.
NONE3 = ("none", "none", "none")


@pytest.fixture(scope="module")
def comfy(comfy_runtime, synthetic_models, tmp_path_factory):
    from tools.runtime.inprocess import import_comfy, import_pack

    mm = import_comfy()
    folder_paths = importlib.import_module("folder_paths")
    sparse = tmp_path_factory.mktemp("sparse_text_encoders")
    for folder in ("text_encoders", "vae"):  # every kind in both, as a user may put them there by mistake
        for kind in ("clip_l", "vae", "unet", "checkpoint"):
            folder_paths.add_model_folder_path(folder, str(synthetic_models[kind].parent))
    folder_paths.add_model_folder_path("text_encoders", str(sparse))
    pack = import_pack()
    module = lambda name: importlib.import_module(f"{pack.__name__}.{name}")  # noqa: E731
    yield mm, importlib.import_module("comfy.sd"), module, synthetic_models, sparse
    mm.unload_all_models()
    gc.collect()


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _assert_same_tensors(theirs: torch.nn.Module, ours: torch.nn.Module) -> None:
    expected, got = _state(theirs), _state(ours)
    assert set(expected) == set(got)
    for key, tensor in expected.items():
        other = got[key]
        assert (other.dtype, other.device, other.shape) == (tensor.dtype, tensor.device, tensor.shape), key
        assert isinstance(other, torch.nn.Parameter) == isinstance(tensor, torch.nn.Parameter), key
        assert key.endswith(UNINITIALISED) or torch.equal(other, tensor), key


def _free(mm, *objects) -> None:
    del objects
    mm.unload_all_models()
    gc.collect()


def _loader(module, name: str):
    return {
        "text": module("nodes.load_text_encoders").LoadTextEncodersWithDevice,
        "vae": module("nodes.load_vae").LoadVAEWithDevice,
    }[name]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("clip_type", ["stable_diffusion", "sd3"])
def test_the_same_text_encoder_as_comfyuis_clip_loader(comfy, clip_type, dtype):
    mm, comfy_sd, module, files, _sparse = comfy
    path = files["clip_l"]
    kind = getattr(comfy_sd.CLIPType, clip_type.upper())
    theirs = comfy_sd.load_clip([str(path)], clip_type=kind, model_options=DTYPES[dtype])
    ours, summary = _loader(module, "text").execute(SD15_CLIP_L, *NONE3, clip_type, "cpu", dtype).args
    assert type(ours.cond_stage_model).__name__ == type(theirs.cond_stage_model).__name__
    _assert_same_tensors(theirs.cond_stage_model, ours.cond_stage_model)
    tokens = theirs.tokenize("a lighthouse at dusk")
    expected = theirs.encode_from_tokens(tokens, return_pooled=True)
    got = ours.encode_from_tokens(tokens, return_pooled=True)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert f"{clip_type} text encoders: CLIP-L ({SD15_CLIP_L})" in summary and "text encoder CLIP-L: cpu" in summary
    _free(mm, theirs, ours)


@pytest.mark.skipif(
    not PRIMARY_PASS,
    reason="two copies of T5-XXL take 9 GB and a minute and a half: checked once, in the primary ComfyUI's pass",
)
def test_flux_text_encoders_with_a_full_size_scaled_fp8_t5_are_comfyuis_class_and_layout(comfy):
    mm, comfy_sd, module, files, sparse = comfy
    layout = layouts()["te_t5xxl_fp8_e4m3fn_scaled.json"]
    t5 = write_sparse_safetensors(layout, sparse / "t5xxl_fp8_e4m3fn_scaled.safetensors")
    theirs = comfy_sd.load_clip([str(files["clip_l"]), str(t5)], clip_type=comfy_sd.CLIPType.FLUX)
    # The file is a hole but for CLIP-L: what ComfyUI built is kept as each tensor's form and, where it holds
    # anything but zeros, its values; then it goes, so that the two full-size T5s are never in RAM at once.
    kind, expected = type(theirs.cond_stage_model).__name__, _form(theirs.cond_stage_model)
    gone = weakref.ref(theirs.cond_stage_model)
    del theirs
    _free(mm)
    assert gone() is None, "ComfyUI's T5 is still held"  # what its process holds, the C allocator may keep
    wait_for_ram(int(9.5 * 2**30))  # ours needs 9.1 GiB available (the job beside may hold 7.5)
    load = _loader(module, "text").execute
    ours, summary = load(SD15_CLIP_L, t5.name, "none", "none", "flux", "cpu", "auto").args
    assert type(ours.cond_stage_model).__name__ == kind
    assert _form(ours.cond_stage_model) == expected
    scales = [k for k in _state(ours.cond_stage_model) if k.endswith("scale_weight")]
    assert len(scales) > 100  # the layers kept ComfyUI's scaled-fp8 form
    assert "text encoder T5-XXL: cpu" in summary
    _free(mm, ours)


def _form(module: torch.nn.Module) -> dict[str, tuple]:
    """Each tensor's dtype, device, shape and kind, and a digest of its bytes where it holds anything but zeros
    (equal digests: equal bit for bit), but for a weight ComfyUI leaves uninitialised."""
    form = {}
    for key, tensor in _state(module).items():
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        digest = None
        if not key.endswith(UNINITIALISED) and bool(raw.any()):
            digest = hashlib.sha256(raw.numpy().tobytes()).hexdigest()
        form[key] = (tensor.dtype, tensor.device, tuple(tensor.shape), isinstance(tensor, torch.nn.Parameter), digest)
    return form


@pytest.mark.parametrize("dtype", ["auto", "fp16", "bf16"])
def test_the_same_vae_as_comfyuis_load_vae(comfy, dtype):
    mm, comfy_sd, module, files, _sparse = comfy
    sd = importlib.import_module("comfy.utils").load_torch_file(str(files["vae"]))
    theirs = comfy_sd.VAE(sd=sd, dtype=DTYPES.get(dtype, {"dtype": torch.bfloat16}).get("dtype"))
    ours, summary = _loader(module, "vae").execute(SD15_VAE, "cpu", dtype).args
    _assert_same_tensors(theirs.first_stage_model, ours.first_stage_model)
    assert (ours.device, ours.vae_dtype, ours.output_device) == (theirs.device, theirs.vae_dtype, theirs.output_device)
    torch.manual_seed(0)
    latent = torch.randn(1, 4, 2, 2)  # convolutions in half precision are slow on a CPU: a 16x16 image
    assert torch.equal(ours.decode(latent), theirs.decode(latent))
    assert "vae: decodes on cpu" in summary
    _free(mm, theirs, ours)


def _with_simulated_gpu(module, monkeypatch):
    return with_simulated_gpu(module, monkeypatch, ("nodes.placing", "nodes.load_text_encoders", "nodes.load_vae"))


def test_text_encoders_are_written_straight_onto_a_simulated_gpu(comfy, monkeypatch):
    mm, _comfy_sd, module, _files, _sparse = comfy
    sim = _with_simulated_gpu(module, monkeypatch)
    clip, summary = _loader(module, "text").execute(SD15_CLIP_L, *NONE3, "stable_diffusion", "gpu:0", "fp16").args
    report = clip.patcher.model.device_control_last_load
    assert report.resident_bytes == report.total_bytes == sim.allocated() > 100 * 1024**2
    assert report.moved_in == 0  # filled where it lives: nothing left to move
    assert "text encoder CLIP-L: gpu:0" in summary
    clip.encode_from_tokens(clip.tokenize("a lighthouse"))  # ComfyUI's own load before encoding keeps the place
    assert clip.patcher.model.device_control_last_load.resident_bytes == sim.allocated() == report.total_bytes
    _free(mm, clip)
    assert sim.allocated() == 0


def test_a_vae_placed_on_a_simulated_gpu_decodes_there(comfy, monkeypatch):
    mm, _comfy_sd, module, _files, _sparse = comfy
    sim = _with_simulated_gpu(module, monkeypatch)
    vae, summary = _loader(module, "vae").execute(SD15_VAE, "gpu:0", "bf16").args
    assert "vae: decodes on gpu:0" in summary and vae.vae_dtype == torch.bfloat16
    decoded = vae.decode(torch.zeros(1, 4, 2, 2))
    report = vae.patcher.model.device_control_last_load
    assert decoded.shape[-1] == 3 and report.target == "sim:0"
    assert report.resident_bytes == report.total_bytes > 50 * 1024**2  # the whole VAE went to the GPU to decode
    assert sim.allocated() >= report.resident_bytes
    del decoded  # it shares storage with the decoder's last activation, which the device's books count
    _free(mm, vae)
    assert sim.allocated() == 0


def _nothing_read(module, monkeypatch) -> list:
    read: list = []
    monkeypatch.setattr(module("core.files.reader").WeightReader, "read_into", lambda *a, **k: read.append(a))
    return read


@pytest.mark.parametrize(
    ("loader", "file", "message"),
    [
        ("text", SD15_UNET, r"is a diffusion model \(Stable Diffusion 1\.5\).*load it with Load Diffusion Model With"),
        ("text", SD15_VAE, r"is a vae .*not a text encoder; load it with Load VAE With Device"),
        ("text", SD15_CHECKPOINT, r"is a checkpoint .*not a text encoder; load it with Load Checkpoint With Device"),
        ("vae", SD15_CLIP_L, r"is a text encoder \(CLIP-L\), not a VAE; load it with Load Text Encoders With Device"),
        ("vae", SD15_UNET, r"is a diffusion model .*not a VAE; load it with Load Diffusion Model With Device"),
    ],
)
def test_a_file_of_another_kind_is_refused_naming_what_it_is_and_what_takes_it(
    comfy, monkeypatch, loader, file, message
):
    _mm, _comfy_sd, module, _files, _sparse = comfy
    read = _nothing_read(module, monkeypatch)
    args = (file, *NONE3, "stable_diffusion", "cpu", "auto") if loader == "text" else (file, "cpu", "auto")
    with pytest.raises(module("core.errors").DeviceControlError, match=message):
        _loader(module, loader).execute(*args)
    assert read == []  # refused before any weight was read


@pytest.mark.parametrize(
    ("clip_type", "message"),
    [
        ("flux", r"type 'flux' takes CLIP-L \+ T5-XXL.*the files given are CLIP-L .*choose the type stable_diffusion"),
        ("wan", r"type 'wan' takes UMT5-XXL; the files given are CLIP-L"),
    ],
)
def test_a_type_that_does_not_take_the_files_is_refused_before_reading(comfy, monkeypatch, clip_type, message):
    _mm, _comfy_sd, module, _files, _sparse = comfy
    read = _nothing_read(module, monkeypatch)
    with pytest.raises(module("core.errors").DeviceControlError, match=message):
        _loader(module, "text").execute(SD15_CLIP_L, *NONE3, clip_type, "cpu", "auto")
    assert read == []


def test_an_fp8_vae_is_refused_with_the_dtypes_a_vae_can_have(comfy):
    _mm, _comfy_sd, module, _files, _sparse = comfy
    answer = _loader(module, "vae").validate_inputs(device="cpu", dtype="fp8_e4m3fn")
    assert answer == (
        "dtype: the VAE cannot be stored in fp8_e4m3fn: ComfyUI's VAE has no cast path for it; "
        "choose fp32, fp16, bf16 or auto for dtype."
    )


def test_a_scaled_fp8_text_encoder_is_refused_before_reading_where_comfyui_quantizes_it(comfy, monkeypatch):
    _mm, _comfy_sd, module, _files, sparse = comfy
    if not module("nodes.model_files").quantizes_scaled_fp8():
        pytest.skip("this ComfyUI builds scaled-fp8 layers as the file has them: the Flux T5 test loads one")
    t5 = write_sparse_safetensors(layouts()["te_t5xxl_fp8_e4m3fn_scaled.json"], sparse / "t5xxl_fp8_scaled.safetensors")
    read = _nothing_read(module, monkeypatch)
    with pytest.raises(
        module("core.errors").DeviceControlError, match=r"t5xxl_fp8_scaled.* fp8 with scales.*Load CLIP"
    ):
        _loader(module, "text").execute(t5.name, *NONE3, "sd3", "cpu", "auto")
    assert read == []


def test_cancel_during_a_text_encoder_load_leaves_nothing_behind(comfy):
    mm, _comfy_sd, module, files, _sparse = comfy
    mm.unload_all_models()
    before = len(mm.current_loaded_models)

    class StopLoadError(Exception):
        pass

    def stop_midway(done: int, total: int) -> None:
        if done > total // 2:
            raise StopLoadError

    header = module("core.detection.headers").read_header(files["clip_l"])
    with pytest.raises(StopLoadError):
        module("nodes.bridge.text_encoders").build_text_encoders(
            [header], "stable_diffusion", module("nodes.bridge.filling").ComponentPlan(), stop_midway
        )
    assert len(mm.current_loaded_models) == before
    gc.collect()


@pytest.mark.parametrize("loader", ["text", "vae"])
def test_a_broken_file_is_refused_with_the_fix_by_both_loaders(comfy, tmp_path, loader):
    _mm, _comfy_sd, module, files, _sparse = comfy
    folder = "text_encoders" if loader == "text" else "vae"
    importlib.import_module("folder_paths").add_model_folder_path(folder, str(tmp_path))
    cut = tmp_path / f"cut_short_{loader}.safetensors"
    cut.write_bytes(files["clip_l" if loader == "text" else "vae"].read_bytes()[: 4 * 1024**2])
    args = (cut.name, *NONE3, "stable_diffusion", "cpu", "auto") if loader == "text" else (cut.name, "cpu", "auto")
    with pytest.raises(module("core.errors").ModelFileError, match=r"outside the .* download it again"):
        _loader(module, loader).execute(*args)
