"""Load Checkpoint With Device in a real ComfyUI: same image as ComfyUI's own loader, placements kept by
ComfyUI through sampling, portable device fallback, and bad files refused while the server keeps serving."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from tools.fixtures.make import SD15_CHECKPOINT
from tools.runtime.server import ComfyError
from tools.templates.workflow_api import load_workflow, ui_to_api

REPO = Path(__file__).resolve().parents[2]
STOCK = REPO / "workflows" / "03 Text to image with VRAM Reports.json"
OURS = REPO / "workflows" / "02 SD1.5 - UNet on the GPU, text encoder on the CPU.json"
GiB = 1024**3


def prompt_of(server, workflow: Path, **loader: str) -> dict:
    """A workflow as an API prompt, with the loader's inputs changed as given."""
    prompt = ui_to_api(load_workflow(workflow), server.get("/object_info"))
    prompt["1"]["inputs"].update(loader)
    return prompt


def loader(entry: dict) -> str:
    return entry["outputs"]["1"]["text"][0]


@pytest.fixture(scope="module")
def sim_server(servers):
    return servers("loader-sim", SIMULATE_GPU="8GiB")


@pytest.fixture(scope="module")
def stock_image(sim_server, api):
    return api.image_of(sim_server, sim_server.run(ui_to_api(load_workflow(STOCK), sim_server.get("/object_info"))))


def test_same_seed_same_image_as_comfyui_loader_fp32_on_cpu(sim_server, api, stock_image):
    entry = sim_server.run(prompt_of(sim_server, OURS, model_device="cpu", clip_device="cpu", vae_device="cpu"))
    assert np.array_equal(api.image_of(sim_server, entry), stock_image)  # fp32 on CPU: bit-identical


def test_unet_on_the_simulated_gpu_gives_the_same_image_and_stays_there(sim_server, api, stock_image):
    prompt = prompt_of(sim_server, OURS)
    entry = sim_server.run(prompt)
    assert np.array_equal(api.image_of(sim_server, entry), stock_image)  # the simulated GPU computes on the CPU
    summary = loader(entry)
    assert "diffusion model: gpu:0 (Simulated GPU 0 (8.00 GiB)), float32" in summary
    assert "text encoder clip l: cpu" in summary
    after_sampling = api.report_json(entry, "7")
    unet = next(m for m in after_sampling["models"] if m["component"] == "MODEL")
    assert unet["resident"] == {"gpu:0": unet["total_bytes"]} and unet["compute_device"] == "gpu:0"
    assert unet["managed_by"] == "Device Control" and not unet["partial"]
    clip = next(m for m in after_sampling["models"] if m["component"] == "CLIP")
    assert clip["resident"] == {"cpu": clip["total_bytes"]}
    sim = next(d for d in after_sampling["devices"] if d["id"] == "gpu:0")
    assert sim["torch_allocated"] >= unet["total_bytes"]  # the simulated device's own books agree


def test_fp16_storage_on_cpu_computes_in_fp32_within_tolerance(sim_server, api, stock_image):
    entry = sim_server.run(prompt_of(sim_server, OURS, model_device="cpu", model_dtype="fp16"))
    assert "float16 (computes in float32)" in loader(entry)
    unet = next(m for m in api.report_json(entry, "7")["models"] if m["component"] == "MODEL")
    assert unet["dtype"] == "float16" and unet["total_bytes"] < 1.7 * GiB
    difference = np.abs(api.image_of(sim_server, entry) - stock_image)
    # fp16 rounding of the weights shifts a few pixel values by a few levels; the image is otherwise the same.
    assert difference.mean() < 1.0 and difference.max() <= 16, (difference.mean(), difference.max())


@pytest.mark.parametrize(("dtype", "stored"), [("fp8_e4m3fn", "float8_e4m3fn"), ("bf16", "bfloat16")])
def test_other_storage_dtypes_stay_as_chosen_through_sampling(sim_server, api, dtype, stored):
    entry = sim_server.run(prompt_of(sim_server, OURS, model_dtype=dtype, clip_dtype=dtype))
    assert f"{stored} (computes in float32)" in loader(entry)
    if dtype.startswith("fp8"):  # the simulated GPU, like most GPUs, cannot compute in fp8: said, and handled
        assert "gpu:0 does not compute in fp8; the weights stay fp8 in memory" in loader(entry)
    models = {m["component"]: m for m in api.report_json(entry, "7")["models"]}
    assert models["MODEL"]["dtype"] == stored and models["MODEL"]["resident"] == {
        "gpu:0": models["MODEL"]["total_bytes"]
    }
    assert models["CLIP"]["dtype"] == stored


def test_a_device_this_machine_lacks_falls_back_with_a_warning(sim_server):
    entry = sim_server.run(prompt_of(sim_server, OURS, model_device="gpu:7", clip_device="cuda:3"))
    summary = loader(entry)
    assert "warning: diffusion model: device 'gpu:7' does not exist on this machine" in summary
    assert "using auto (ComfyUI's choice) instead" in summary
    assert "diffusion model: cpu" in summary


def test_a_malformed_device_is_a_validation_error(sim_server):
    with pytest.raises(ComfyError, match="model_device: 'tpu:0' is not a device"):
        sim_server.queue(prompt_of(sim_server, OURS, model_device="tpu:0"))


def _header_past_end(path: Path) -> None:
    with open(path, "r+b") as handle:
        handle.write(struct.pack("<Q", 10**12))


def _garble(path: Path) -> None:
    with open(path, "r+b") as handle:
        handle.seek(8)
        handle.write(b"{{{{ not json")


def _overlap(path: Path) -> None:
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 12)


def _unknown(path: Path) -> None:
    header = {"encoder.fc.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 16)


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _unsafe_pickle(path: Path) -> None:
    import pickle

    class Payload:
        def __reduce__(self):
            return (exec, ("open('/tmp/device_control_pwned', 'w')",))

    path.write_bytes(pickle.dumps({"state_dict": {"x": Payload()}}))


BAD_FILES = [
    ("truncated.safetensors", lambda _path: None, "outside the"),
    ("header_past_end.safetensors", _header_past_end, "runs past the end of the file"),
    ("garbled.safetensors", _garble, "JSON header cannot be parsed"),
    ("overlap.safetensors", _overlap, "overlap in the file"),
    ("unknown.safetensors", _unknown, "is not a model family ComfyUI can build"),
    ("empty.safetensors", _empty, "is empty (0 bytes)"),
    ("evil.ckpt", _unsafe_pickle, "is an unsafe pickle"),
]


@pytest.fixture(scope="module")
def bad_server(synthetic_models, comfy_factory, tmp_path_factory):
    base = tmp_path_factory.mktemp("loader-bad")
    checkpoints = base / "models" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / SD15_CHECKPOINT).symlink_to(synthetic_models["checkpoint"])
    with open(synthetic_models["checkpoint"], "rb") as handle:
        start = handle.read(256 * 1024)  # the whole header and a little data: a download cut short
    for name, make, _ in BAD_FILES:
        target = checkpoints / name
        target.write_bytes(start)
        make(target)
    server = comfy_factory(base)
    yield server
    server.stop()


@pytest.mark.parametrize(("name", "problem"), [(n, p) for n, _, p in BAD_FILES], ids=[n for n, _, _ in BAD_FILES])
def test_bad_files_get_a_clear_error_and_the_server_keeps_serving(bad_server, name, problem):
    with pytest.raises(ComfyError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        bad_server.run(prompt_of(bad_server, OURS, ckpt_name=name, model_device="cpu"))
    assert not Path("/tmp/device_control_pwned").exists()
    entry = bad_server.run(prompt_of(bad_server, OURS, model_device="cpu"))  # the next prompt still works
    cached = [
        node for kind, data in entry["status"]["messages"] if kind == "execution_cached" for node in data["nodes"]
    ]
    # ComfyUI 0.28 leaves a node whose output it had cached out of the history's outputs (0.3.x repeats them).
    assert "1" in cached or "Stable Diffusion 1.5 (SD15, EPS)" in loader(entry)


def test_the_error_dialog_names_our_exception_type_readably(bad_server):
    """ComfyUI imports the pack under its folder's path; the dialog must not print that path as a module name."""
    prompt_id = bad_server.queue(prompt_of(bad_server, OURS, ckpt_name="empty.safetensors", model_device="cpu"))
    with pytest.raises(ComfyError):
        bad_server.wait(prompt_id)
    messages = bad_server.get(f"/history/{prompt_id}")[prompt_id]["status"]["messages"]
    error = next(data for kind, data in messages if kind == "execution_error")
    assert error["exception_type"] == "device_control.ModelFileError"
