"""GGUF diffusion models in Load Diffusion Model With Device, in this process, against ComfyUI's own Load Diffusion
Model given the same model dequantised (the oracle: every tensor as the GGML project's ``gguf`` package reads it,
saved as float32 safetensors). The files are our synthetic Wan 2.1 and SD3.5 models quantised by ``gguf`` itself
(``tools/fixtures/gguf_files.py``): SD3.5 in Q4_0 blocks with vectors in F32; Wan as ComfyUI-GGUF's tools leave it, Q8_0
from an fp16 model (F16 plain tensors) and Q4_K_M from a bf16 one (Q4_K and Q6_K blocks, BF16 and F32 plain
tensors), its patch embedding a five-dimensional F32 tensor.

What holds: the model keeps the file's blocks (uint8, the bytes the fit plan counts) and computes bit for bit what
the dequantised model computes, resident or streamed from a simulated GPU under a budget that counts quantised
bytes; a stock LoRA applies to the dequantised weights, resident and streamed alike; a broken or wrong GGUF is
refused before a weight is read, and so is a damaged file named ``.gguf``, as a damaged GGUF. On a real server,
VRAM Report names the Q4_K_M model by its file type and all its storage types, and a damaged GGUF is refused with
the fix while the server keeps serving.
"""

from __future__ import annotations

import gc
import importlib
import json
import shutil

import pytest
import torch

from tests.integration.simulated import with_simulated_gpu
from tools.fixtures.gguf_files import dequantised_twin, write_comfyui_gguf, write_gguf
from tools.runtime.server import ComfyError

MiB = 1024**2


def _wan_inputs() -> dict:
    return {"x": torch.randn(1, 16, 1, 8, 8), "c_crossattn": torch.randn(1, 7, 4096)}


#: Our file name -> (make_all() key, quantisation, how it is written, its block types as the summary names them,
#: the stand-in inputs of one step).
MODELS = {
    "wan21_Q8_0": ("wan21", "Q8_0", "comfyui-gguf F16", "Q8_0", _wan_inputs),
    "wan21_Q4_K_M": ("wan21", "Q4_K_M", "comfyui-gguf BF16", "Q4_K/Q6_K", _wan_inputs),
    "sd35_Q4_0": (
        "sd35",
        "Q4_0",
        "gguf sd3",
        "Q4_0",
        lambda: {"x": torch.randn(1, 16, 8, 8), "c_crossattn": torch.randn(1, 7, 4096), "y": torch.randn(1, 2048)},
    ),
}


def write_model(synthetic_models: dict, name: str, folder) -> object:
    """The GGUF file ``name`` of :data:`MODELS` in ``folder`` (made once)."""
    key, quant, how, _blocks, _inputs = MODELS[name]
    writer, argument = how.split()
    if writer == "comfyui-gguf":  # its tools' way: tools/convert.py, the patched quantiser, fix_5d_tensors.py
        return write_comfyui_gguf(synthetic_models[key], folder / f"{name}.gguf", quant, argument)
    return write_gguf(synthetic_models[key], folder / f"{name}.gguf", quant, argument)


@pytest.fixture(scope="module")
def comfy(comfy_runtime, synthetic_models, module_folder):
    from tools.runtime.inprocess import import_comfy, import_pack

    mm = import_comfy()
    folder = module_folder
    files = {}
    for name in MODELS:
        gguf_file = write_model(synthetic_models, name, folder)
        files[name] = (gguf_file, dequantised_twin(gguf_file, folder / f"{name}_dequantised.safetensors"))
    folder_paths = importlib.import_module("folder_paths")
    folder_paths.add_model_folder_path("diffusion_models", str(folder))
    pack = import_pack()
    module = lambda name: importlib.import_module(f"{pack.__name__}.{name}")  # noqa: E731
    yield mm, importlib.import_module("comfy.sd"), module, files, synthetic_models
    mm.unload_all_models()
    gc.collect()


def _load(module, name: str, device: str = "cpu", dtype: str = "auto"):
    return module("nodes.load_diffusion_model").LoadDiffusionModelWithDevice.execute(name, device, dtype).args


def _step(patcher, inputs: dict) -> torch.Tensor:
    mm = importlib.import_module("comfy.model_management")
    mm.load_models_gpu([patcher])
    args = dict(inputs)
    x = args.pop("x")
    with torch.no_grad():
        return patcher.model.apply_model(x, torch.tensor([500.0]), **args).clone()


def _quantised(model: torch.nn.Module, module) -> dict[str, tuple[torch.nn.Module, str]]:
    layout_of = module("core.weights.quantized").layout_of
    return {
        f"{path}.{name}": (layer, name)
        for path, layer in model.named_modules()
        for name, _ in layer.named_parameters(recurse=False)
        if layout_of(layer, name) is not None
    }


@pytest.mark.parametrize("key", sorted(MODELS))
def test_the_blocks_stay_quantised_and_the_model_computes_as_its_dequantised_twin(comfy, key):
    mm, comfy_sd, module, files, _models = comfy
    gguf_file, twin_file = files[key]
    listed = module("nodes.model_files").model_files("diffusion_models", gguf=True)
    assert gguf_file.name in listed and twin_file.name in listed  # ComfyUI's own list has no .gguf
    assert gguf_file.name not in importlib.import_module("folder_paths").get_filename_list("diffusion_models")
    ours, summary = _load(module, gguf_file.name)
    theirs = comfy_sd.load_diffusion_model(str(twin_file))
    quantised = _quantised(ours.model.diffusion_model, module)
    assert len(quantised) > 10
    expected = dict(theirs.model.diffusion_model.named_parameters())
    for name, (layer, attr) in quantised.items():
        blocks = getattr(layer, attr)
        layout = module("core.weights.quantized").layout_of(layer, attr)
        assert blocks.dtype == torch.uint8 and blocks.numel() == layout.kind.nbytes(expected[name].numel()), name
        assert blocks.shape == expected[name].shape, name  # what ComfyUI reads (Flux's and Wan's input channels)
        assert torch.equal(layout.decode(blocks, torch.float32), expected[name]), name
    plain = {n: p for n, p in ours.model.diffusion_model.named_parameters() if n not in quantised}
    assert plain.keys() | quantised.keys() == expected.keys()
    assert all(torch.equal(p.float(), expected[n]) for n, p in plain.items())  # Wan's 5-D patch embedding too
    floats = sum(expected[name].numel() * expected[name].element_size() for name in quantised)
    blocks = sum(getattr(layer, attr).numel() for layer, attr in quantised.values())
    assert ours.model_size() == theirs.model_size() - floats + blocks  # ComfyUI's books count the blocks
    assert blocks < floats / 3
    torch.manual_seed(0)
    inputs = MODELS[key][4]()
    assert torch.equal(_step(ours, inputs), _step(theirs, inputs))
    blocks = MODELS[key][3]
    assert "diffusion model: cpu (" in summary and f"GGUF {blocks} blocks (computes in float32)" in summary, summary
    del ours, theirs
    mm.unload_all_models()
    gc.collect()


def _simulated(module, monkeypatch):
    return with_simulated_gpu(module, monkeypatch, ("nodes.placing", "nodes.load_diffusion_model", "nodes.move_to_gpu"))


def test_on_a_simulated_gpu_under_a_budget_it_holds_quantised_bytes_and_computes_the_same(comfy, monkeypatch):
    mm, _comfy_sd, module, files, _models = comfy
    gguf_file, _twin = files["sd35_Q4_0"]
    torch.manual_seed(1)
    inputs = MODELS["sd35_Q4_0"][4]()
    resident, _ = _load(module, gguf_file.name)
    expected = _step(resident, inputs)
    sim = _simulated(module, monkeypatch)
    whole, summary = _load(module, gguf_file.name, "gpu:0")
    size = whole.model_size()
    assert whole.model.device_control_last_load.resident_bytes == size == sim.allocated()  # blocks, not floats
    blocks = _quantised(whole.model.diffusion_model, module)
    block_bytes = sum(getattr(layer, attr).numel() for layer, attr in blocks.values())
    # Room for most of the blocks beside what cannot stream (the positional table) and the streaming reserve, which
    # holds a streamed block decoded (in float32 at most, its temporaries in a caching allocator's blocks: several
    # times its bytes): the largest blocks resident, the rest streamed. With less room (an eighth of the blocks
    # more), the reserve for the largest block leaves room for none.
    budget = size - block_bytes // 8
    moved = module("nodes.move_to_gpu").MoveToGPU.execute(whole, "gpu:0", f"{budget / MiB:.3f}MiB", False).args[0]
    report = moved.model.device_control_last_load
    assert 0 < report.resident_bytes <= budget and report.streamed_bytes > 0
    sim_tensor = module("core.devices.sim.tensor").SimTensor
    on_device = [layer for layer, attr in blocks.values() if isinstance(getattr(layer, attr), sim_tensor)]
    assert 0 < len(on_device) < len(blocks)  # some blocks resident on the GPU, the rest streamed as blocks
    assert all(getattr(layer, attr).dtype == torch.uint8 for layer, attr in blocks.values())
    assert torch.equal(_step(moved, inputs), expected)
    assert "gpu:0" in summary
    report = json.loads(module("nodes.vram_report").VRAMReport.execute("gguf", value=moved).args[2])
    assert report["subject"]["dtype"] == "Q4_0"  # how its bytes are stored, not uint8
    del resident, whole, moved
    mm.unload_all_models()
    gc.collect()


def test_a_lora_applies_to_the_dequantised_weights_resident_and_streamed(comfy, monkeypatch):
    mm, comfy_sd, module, files, models = comfy
    gguf_file, twin_file = files["sd35_Q4_0"]
    lora = importlib.import_module("comfy.utils").load_torch_file(str(models["lora_sd35"]))
    torch.manual_seed(2)
    inputs = MODELS["sd35_Q4_0"][4]()
    theirs = comfy_sd.load_lora_for_models(comfy_sd.load_diffusion_model(str(twin_file)), None, lora, 0.8, 0)[0]
    expected = _step(theirs, inputs)
    ours = comfy_sd.load_lora_for_models(_load(module, gguf_file.name)[0], None, lora, 0.8, 0)[0]
    patched = _step(ours, inputs)
    plain = _step(_load(module, gguf_file.name)[0], inputs)
    assert not torch.equal(patched, plain)  # the LoRA changed the result
    assert torch.equal(patched, expected)  # the same patch math on the same float32 weights
    blocks = _quantised(ours.model.diffusion_model, module)
    assert all(getattr(layer, attr).dtype == torch.uint8 for layer, attr in blocks.values())  # never baked in
    sim = _simulated(module, monkeypatch)
    streamed = module("nodes.move_to_gpu").MoveToGPU.execute(ours, "gpu:0", "2MiB", False).args[0]
    assert streamed.model.device_control_last_load.streamed_bytes > 0 and sim.allocated() > 0
    factors, placements = module("core.weights.patch_factors"), []
    place_many = factors.place_many
    monkeypatch.setattr(
        factors, "place_many", lambda requests, target: placements.append(len(requests)) or place_many(requests, target)
    )
    assert torch.equal(_step(streamed, inputs), patched)
    on_the_fly = module("core.weights.patching").OnTheFlyPatch
    functions = [
        f for m in streamed.model.modules() for f in getattr(m, "weight_function", ()) if isinstance(f, on_the_fly)
    ]
    # Every patched weight's factors (the LoRA covers 29 of the 44 GGUF weights), resident and streamed, crossed in
    # one block at the first forward after the load (issue 57, item 3): before, one block per weight.
    assert placements == [len(functions)] and len(functions) > 1, placements
    del theirs, ours, streamed
    mm.unload_all_models()
    gc.collect()


def _truncated(path, target):
    shutil.copyfile(path, target)
    with open(target, "r+b") as handle:
        handle.truncate(target.stat().st_size // 2)
    return target


def _damaged(path, folder) -> dict:
    """Files named ``.gguf`` that are not whole GGUF files (the first bytes lost, a web page saved in a download's
    place, a header cut short), each with the problem a loader must name: a damaged GGUF, not a safetensors file."""
    whole = path.read_bytes()
    made = {
        "zeroed.gguf": (b"\0" * 8 + whole[8:], r"its magic is b'\\x00\\x00\\x00\\x00', where a GGUF file starts with"),
        "page.gguf": (b"<!DOCTYPE html><html>Not found</html>", r"its magic is b'<!DO', where a GGUF file starts with"),
        "cut.gguf": (whole[:20], r"the header runs past the end of the file \(20 bytes\)"),
    }
    for name, (raw, _problem) in made.items():
        (folder / name).write_bytes(raw)
    return {folder / name: problem for name, (_raw, problem) in made.items()}


def record_reads(module, monkeypatch) -> list:
    """Every weight the pack's reader reads from now on (none is read, only recorded): the list to check."""
    reader = module("core.files.reader").WeightReader
    read: list = []
    monkeypatch.setattr(reader, "read_into", lambda *a, **k: read.append(a))
    monkeypatch.setattr(reader, "read_blocks_into", lambda *a, **k: read.append(a))
    return read


def test_a_broken_or_wrong_gguf_is_refused_before_a_weight_is_read(comfy, monkeypatch, tmp_path):
    _mm, _comfy_sd, module, files, _models = comfy
    importlib.import_module("folder_paths").add_model_folder_path("diffusion_models", str(tmp_path))
    read = record_reads(module, monkeypatch)
    error = module("core.errors").DeviceControlError
    truncated = _truncated(files["wan21_Q8_0"][0], tmp_path / "truncated.gguf")
    with pytest.raises(error, match=r"truncated\.gguf is not a valid GGUF file: tensor .* lies outside the file"):
        _load(module, truncated.name)
    for damaged, problem in _damaged(files["wan21_Q8_0"][0], tmp_path).items():
        with pytest.raises(error, match=rf"{damaged.name} is not a valid GGUF file: {problem}.*download it again"):
            _load(module, damaged.name)
    from tests.core.test_gguf_header import write_sparse_gguf

    gguf = importlib.import_module("gguf")
    unknown = write_sparse_gguf(
        {"blk.0.weight": ([8, 256], gguf.GGMLQuantizationType.IQ2_XXS)}, tmp_path / "iq.gguf", "x"
    )
    with pytest.raises(error, match=r"tensor 'blk\.0\.weight' of iq\.gguf is stored in GGML type 16"):
        _load(module, unknown.name)
    encoder = write_sparse_gguf(
        {
            "token_embd.weight": ([32128, 4096], gguf.GGMLQuantizationType.Q8_0),
            "blk.0.attn_q.weight": ([4096, 4096], gguf.GGMLQuantizationType.Q8_0),
        },
        tmp_path / "t5xxl.gguf",
        "t5encoder",
    )
    with pytest.raises(
        error,
        match=(
            r"t5xxl\.gguf is a text encoder \(t5encoder text encoder, llama.cpp tensor names\), not a diffusion "
            r"model; load it with a GGUF loader pack"
        ),
    ):
        _load(module, encoder.name)
    assert read == []


@pytest.fixture(scope="module")
def gguf_server(synthetic_models, comfy_factory, tmp_path_factory):
    """A real ComfyUI whose diffusion models are the mixed Q4_K_M Wan file and damaged files named ``.gguf``."""
    base = tmp_path_factory.mktemp("gguf-server")
    models = base / "models" / "diffusion_models"
    models.mkdir(parents=True)
    mixed = write_model(synthetic_models, "wan21_Q4_K_M", models)
    _damaged(mixed, models)
    server = comfy_factory(base)
    yield server
    server.stop()


def _loader_prompt(name: str) -> dict:
    load = {"unet_name": name, "device": "cpu", "dtype": "auto"}
    return {
        "1": {"class_type": "DeviceControl_LoadDiffusionModel", "inputs": load},
        "2": {"class_type": "DeviceControl_VRAMReport", "inputs": {"label": "", "devices": "all", "value": ["1", 0]}},
    }


def test_vram_report_names_a_mixed_gguf_by_its_file_type_and_storage_types(gguf_server, api):
    """Not ``float32``, the type of most of this small model's bytes: its file type, its block types by their
    share, then its plain tensors (the BF16 and F32 ones of the file, in the float32 this loader chose on a CPU)."""
    entry = gguf_server.run(_loader_prompt("wan21_Q4_K_M.gguf"))
    subject = api.report_json(entry, "2")["subject"]
    assert subject["dtype"] == "Q4_K_M: Q4_K/Q6_K blocks, F32 plain", subject
    assert "Q4_K_M: Q4_K/Q6_K blocks, F32 plain" in api.report_text(entry, "2")


@pytest.mark.parametrize("name", ["zeroed.gguf", "page.gguf", "cut.gguf"])
def test_a_damaged_gguf_is_named_so_and_the_server_keeps_serving(gguf_server, api, name):
    with pytest.raises(ComfyError, match=rf"{name} is not a valid GGUF file: .*download it again") as raised:
        gguf_server.run(_loader_prompt(name))
    assert "safetensors" not in str(raised.value)
    entry = gguf_server.run(_loader_prompt("wan21_Q4_K_M.gguf"))
    assert "Q4_K_M" in api.report_json(entry, "2")["subject"]["dtype"]
