"""Split Model Across Devices in a real ComfyUI on three simulated GPUs (4 GiB, 4 GiB, 2 GiB): the image of
ComfyUI's own nodes in both modes, with a LoRA; each device's bytes read from its books and from the VRAM Report;
the next sampler keeps the split; Offload To CPU and Move To GPU undo it; bad input refused before a weight moves.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.passes import ONCE
from tools.fixtures.make import SD15_CHECKPOINT, SD15_CHECKPOINT_B, SD15_LORA
from tools.runtime.server import ComfyError

GiB = 1024**3
#: Tests of what the node decides before ComfyUI loads anything (the allocation's text, its devices, the input's
#: kind): the same code in every ComfyUI version, so they run once, in the primary version's pass.
WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows"
#: Several full-size models at once: runs while no other tier's module does (tests/server_pool.py).
HOLDS_MODELS = True
EXAMPLE = WORKFLOWS / "12 Flux dev split across two GPUs.json"
ALLOCATION = "gpu:0=40%, gpu:1=30%, gpu:2=*"


def _prompt(split: dict | None, *, lora: bool = False, after: list[dict] | None = None) -> dict:
    """Checkpoint (ComfyUI's loader) -> [LoRA] -> [Split] -> KSampler -> decode -> save, with VRAM Reports after
    the split ("20") and after sampling ("21"); ``after`` adds nodes taking the sampled latent's trigger."""
    model = ["1", 0]
    prompt: dict = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": SD15_CHECKPOINT}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a lighthouse", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["1", 1]}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
    }
    if lora:
        prompt["5"] = {
            "class_type": "LoraLoaderModelOnly",
            "inputs": {"model": model, "lora_name": SD15_LORA, "strength_model": 1.0},
        }
        model = ["5", 0]
    if split is not None:
        prompt["6"] = {"class_type": "DeviceControl_SplitModel", "inputs": {"model": model, **split}}
        prompt["20"] = {
            "class_type": "DeviceControl_VRAMReport",
            "inputs": {"label": "split", "devices": "all", "value": ["6", 1]},
        }
        model = ["6", 0]
    prompt["7"] = {
        "class_type": "KSampler",
        "inputs": {
            "model": model,
            "seed": 7,
            "steps": 1,
            "cfg": 5.0,
            "sampler_name": "euler",
            "scheduler": "normal",
            "positive": ["2", 0],
            "negative": ["3", 0],
            "latent_image": ["4", 0],
            "denoise": 1.0,
        },
    }
    prompt["8"] = {"class_type": "VAEDecode", "inputs": {"samples": ["7", 0], "vae": ["1", 2]}}
    prompt["9"] = {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "split"}}
    prompt["21"] = {
        "class_type": "DeviceControl_VRAMReport",
        "inputs": {"label": "sampled", "devices": "all", "value": ["8", 0]},
    }
    for index, node in enumerate(after or []):
        prompt[str(30 + index)] = node
    return prompt


@pytest.fixture(scope="module")
def server(servers, server_pool):
    """The module's server; the pool's idle ones are stopped first: several SD1.5 and Flux models are split here."""
    server_pool.stop_idle()
    return servers("split-3gpu", SIMULATE_GPU="4GiB,4GiB,2GiB")


def _move_to_gpu(model: list, device: str) -> dict:
    """A Move To GPU of ``model`` after the image is decoded."""
    inputs = {"model": model, "device": device, "vram_budget": "all", "keep_resident": False, "trigger": ["8", 0]}
    return {"class_type": "DeviceControl_MoveToGPU", "inputs": inputs}


def _report(label: str, value: list) -> dict:
    return {"class_type": "DeviceControl_VRAMReport", "inputs": {"label": label, "devices": "all", "value": value}}


def _offload_all() -> dict:
    """Offload To CPU's inputs that give every device back, after the image is decoded."""
    return {"mode": "all models", "free_amount": "2GB", "empty_cache": True, "trigger": ["8", 0]}


def _model(entry: dict, api, node: str) -> dict:
    return next(m for m in api.report_json(entry, node)["models"] if m["component"] == "MODEL")


def _allocated(entry: dict, api, node: str) -> dict[str, int]:
    return {d["id"]: d["torch_allocated"] for d in api.report_json(entry, node)["devices"] if d["id"] != "cpu"}


@pytest.mark.parametrize("mode", ["pipeline", "stream"])
def test_a_split_gives_comfyuis_image_and_each_device_holds_its_part(server, api, mode):
    stock = api.image_of(server, server.run(_prompt(None)))  # ComfyUI loads the model first, its own way
    entry = server.run(_prompt({"allocation": ALLOCATION, "mode": mode}))
    assert np.array_equal(api.image_of(server, entry), stock), f"{mode}: not the image of ComfyUI's own nodes"
    split, sampled = _model(entry, api, "20"), _model(entry, api, "21")
    total = split["total_bytes"]
    resident = split["resident"]
    assert sum(resident.values()) == total
    # The sampling schedule (a few KiB) stays beside the sampler's tensors, in RAM for a simulated GPU.
    assert resident.pop("cpu", 0) < 2**20 and set(resident) == {"gpu:0", "gpu:1", "gpu:2"}, resident
    assert abs(resident["gpu:0"] - 0.4 * total) < 0.1 * total and abs(resident["gpu:1"] - 0.3 * total) < 0.1 * total
    assert {d: n for d, n in sampled["resident"].items() if d != "cpu"} == resident, "the sampler moved the split"
    allocated = _allocated(entry, api, "20")
    assert all(allocated[d] >= resident[d] for d in resident), (allocated, resident)  # the devices' own books
    summary = entry["outputs"]["6"]["text"][0]
    assert f"{mode} over gpu:0, gpu:1, gpu:2" in summary and "before:" in summary
    # ComfyUI's own nodes on the same model afterwards: the split is given back, the image is theirs again.
    again = server.run(_prompt(None))
    assert np.array_equal(api.image_of(server, again), stock)
    assert all(v == 0 for v in _allocated(again, api, "21").values()), "the split stayed behind"


def _clip_prompt(lora: bool) -> dict:
    """The graph of :func:`_prompt`, with ComfyUI's stock LoRA loader on the model and the text encoder."""
    prompt = _prompt(None, lora=lora)
    if lora:
        prompt["5"]["class_type"] = "LoraLoader"
        prompt["5"]["inputs"].update(clip=["1", 1], strength_clip=1.0)
        for node in ("2", "3"):
            prompt[node]["inputs"]["clip"] = ["5", 1]
    return prompt


def _split_clip(prompt: dict, allocation: str, mode: str) -> dict:
    """``prompt`` with its text encoder split ("60", reported by "61") before both prompts are encoded."""
    clip = prompt["2"]["inputs"]["clip"]
    prompt["60"] = {
        "class_type": "DeviceControl_SplitModel",
        "inputs": {"model": clip, "allocation": allocation, "mode": mode},
    }
    prompt["61"] = _report("clip split", ["60", 0])
    for node in ("2", "3"):
        prompt[node]["inputs"]["clip"] = ["61", 0]
    return prompt


@pytest.mark.parametrize(
    ("mode", "lora"),
    [
        pytest.param("pipeline", False, id="pipeline"),
        pytest.param("pipeline", True, id="pipeline-lora", marks=ONCE),
        pytest.param("stream", False, id="stream", marks=ONCE),
        pytest.param("stream", True, id="stream-lora", marks=ONCE),
    ],
)
def test_a_text_encoder_split_gives_comfyuis_image_and_each_device_holds_its_part(server, api, mode, lora):
    stock = api.image_of(server, server.run(_clip_prompt(lora)))
    entry = server.run(_split_clip(_clip_prompt(lora), "gpu:1=50%, gpu:2=*", mode))
    assert np.array_equal(api.image_of(server, entry), stock), f"{mode}: not the image of ComfyUI's own nodes"
    clip = next(m for m in api.report_json(entry, "61")["models"] if m["component"] == "CLIP")
    resident, total = dict(clip["resident"]), clip["total_bytes"]
    # What is outside the encoder's transformer (a scalar) stays beside the caller, in RAM for a simulated GPU.
    assert resident.pop("cpu", 0) < 2**20 and set(resident) == {"gpu:1", "gpu:2"}, resident
    assert sum(resident.values()) > total - 2**20 and min(resident.values()) > 0.3 * total, resident
    assert f"{mode} over gpu:1, gpu:2" in entry["outputs"]["60"]["text"][0]
    allocated = _allocated(entry, api, "61")
    assert all(allocated[d] >= resident[d] for d in resident), (allocated, resident)
    if mode == "stream":  # after both prompts are encoded, nothing queued for a third call stays on a GPU
        kept = next(m for m in api.report_json(entry, "21")["models"] if m["component"] == "CLIP")["resident"]
        kept.pop("cpu", None)
        after = _allocated(entry, api, "21")
        assert {d: after[d] for d in kept} == kept, (after, kept)
    # ComfyUI's own nodes on the same text encoder afterwards: the split is given back, the image is theirs.
    again = server.run(_clip_prompt(lora))
    assert np.array_equal(api.image_of(server, again), stock)
    assert all(v == 0 for v in _allocated(again, api, "21").values()), "the split stayed behind"


def test_a_lora_gives_comfyuis_image_on_a_split_model(server, api):
    stock = api.image_of(server, server.run(_prompt(None, lora=True)))
    entry = server.run(_prompt({"allocation": ALLOCATION, "mode": "pipeline"}, lora=True))
    assert np.array_equal(api.image_of(server, entry), stock)
    # The LoRA loaded after the split: the sampler's clone carries other patches, so the split is made again
    # with them, on the same devices.
    after = _prompt({"allocation": ALLOCATION, "mode": "stream"})
    after["5"] = {
        "class_type": "LoraLoaderModelOnly",
        "inputs": {"model": ["6", 0], "lora_name": SD15_LORA, "strength_model": 1.0},
    }
    after["7"]["inputs"]["model"] = ["5", 0]
    entry = server.run(after)
    assert np.array_equal(api.image_of(server, entry), stock)
    resident = _model(entry, api, "21")["resident"]
    assert {"gpu:0", "gpu:1", "gpu:2"} <= set(resident), resident


def test_a_streamed_split_leaves_only_its_parts_on_the_gpus_when_sampling_ends(server, api):
    """Over several steps the prefetch copies the next step's first layers while a step's last ones compute;
    when sampling ends the patcher's cleanup drops them: each GPU holds exactly its part, as ComfyUI's books say."""
    prompt = _prompt({"allocation": ALLOCATION, "mode": "stream"})
    prompt["7"]["inputs"]["steps"] = 3
    entry = server.run(prompt)
    resident = _model(entry, api, "21")["resident"]
    resident.pop("cpu", None)
    assert _allocated(entry, api, "21") == resident, "copies queued for a next step stayed on the computing GPU"


def test_offload_to_cpu_gives_every_device_back(server, api):
    offload = {
        "class_type": "DeviceControl_OffloadToCPU",
        "inputs": {"model": ["6", 0], "mode": "full", "free_amount": "2GB", "empty_cache": True, "trigger": ["8", 0]},
    }
    report = {
        "class_type": "DeviceControl_VRAMReport",
        "inputs": {"label": "off", "devices": "all", "value": ["30", 0]},
    }
    entry = server.run(_prompt({"allocation": ALLOCATION, "mode": "pipeline"}, after=[offload, report]))
    before = _allocated(entry, api, "20")
    after = _allocated(entry, api, "31")
    assert all(before[d] > 0 for d in before) and all(after[d] == 0 for d in after), (before, after)
    assert not any(m["component"] == "MODEL" for m in api.report_json(entry, "31")["models"])


@ONCE
def test_a_missing_device_is_left_out_with_a_warning(server, api):
    entry = server.run(_prompt({"allocation": "gpu:0=50%, gpu:7=*", "mode": "pipeline"}))
    summary = entry["outputs"]["6"]["text"][0]
    assert "warning: device 'gpu:7' does not exist" in summary
    resident = _model(entry, api, "20")["resident"]
    assert set(resident) == {"gpu:0", "cpu"} and resident["cpu"] > 2**20, resident


@ONCE
@pytest.mark.parametrize(
    ("allocation", "words"),
    [
        ("gpu:0=1GB, gpu:1=1GB", "short"),
        ("gpu:2=3GB, gpu:0=*", "gpu:2 has 2.00 GiB in all"),
        ("gpu:0=50%, gpu:0=50%", "names gpu:0 twice"),
        ("gpu:0=120%", "at most 100%"),
        ("gpu:0 10GB", "write it as"),
    ],
)
def test_bad_allocations_are_refused_before_a_weight_moves(server, api, allocation, words):
    before = _allocated(server.run(api.report_prompt()), api, "1")
    with pytest.raises(ComfyError) as caught:
        server.run(_prompt({"allocation": allocation, "mode": "pipeline"}))
    assert words in str(caught.value)
    assert _allocated(server.run(api.report_prompt()), api, "1") == before, "a refused split moved weights"


@ONCE
def test_a_vae_cannot_be_wired_into_a_split_it_is_refused_when_queued(server, api):
    # The input takes MODEL or CLIP only, so ComfyUI refuses the link before anything runs (it once took a VAE
    # and refused it at run time).
    prompt = _prompt({"allocation": ALLOCATION, "mode": "pipeline"})
    prompt["6"]["inputs"]["model"] = ["1", 2]
    prompt["7"]["inputs"]["model"] = ["1", 0]
    with pytest.raises(ComfyError, match="refused nodes") as caught:
        server.run(prompt)
    assert "VAE" in str(caught.value) and "MODEL,CLIP" in str(caught.value)


def test_the_example_workflow_splits_flux_over_two_gpus_with_the_stock_image(server, api):
    prompt = api.load_prompt(server, EXAMPLE)
    server.free()
    entry = server.run(prompt)
    report = _model(entry, api, "3")
    assert "Flux" in report["name"], report["name"]
    resident, total = dict(report["resident"]), report["total_bytes"]
    resident.pop("cpu", 0)
    assert set(resident) == {"gpu:0", "gpu:1"} and sum(resident.values()) > total - 2**20, resident
    # Half and half within a block: this small Flux has one double and one single block (and its embeddings).
    assert min(resident.values()) > 0.2 * total, resident
    assert {d: n for d, n in _model(entry, api, "10")["resident"].items() if d != "cpu"} == resident
    server.free()
    stock = server.run(api.stock_equivalent(prompt))
    assert np.array_equal(api.image_of(server, entry), api.image_of(server, stock))


@ONCE
def test_flux_with_a_stock_lora_streamed_from_a_second_gpu_gives_the_stock_image(server, api, synthetic_models):
    """The example's DiT with a LoRA from ComfyUI's stock loader, in stream mode (gpu:0 computes, gpu:1 lends):
    the LoRA is applied once to the stored weights, those streamed from gpu:1 too."""
    prompt = api.load_prompt(server, EXAMPLE)
    lora = {"model": ["1", 0], "lora_name": synthetic_models["lora_flux"].name, "strength_model": 1.0}
    prompt["20"] = {"class_type": "LoraLoaderModelOnly", "inputs": lora}
    prompt["2"]["inputs"].update(model=["20", 0], mode="stream")
    server.free()
    entry = server.run(prompt)
    resident = _model(entry, api, "10")["resident"]
    assert resident.get("gpu:0", 0) > 0 and resident.get("gpu:1", 0) > 0, resident
    assert "stream over gpu:0, gpu:1" in entry["outputs"]["2"]["text"][0]
    server.free()
    stock = server.run(api.stock_equivalent(prompt))
    assert np.array_equal(api.image_of(server, entry), api.image_of(server, stock))


def test_move_to_gpu_ends_a_split_and_places_the_model_on_one_device(server, api):
    after = [_move_to_gpu(["6", 0], "gpu:0"), _report("moved", ["30", 0])]
    entry = server.run(_prompt({"allocation": ALLOCATION, "mode": "stream"}, after=after))
    moved = _model(entry, api, "31")
    assert moved["resident"] == {"gpu:0": moved["total_bytes"]}
    allocated = _allocated(entry, api, "31")
    assert allocated["gpu:1"] == 0 and allocated["gpu:2"] == 0, allocated


def test_another_model_needing_a_gpu_evicts_the_split(server, api):
    second = {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": SD15_CHECKPOINT_B}}
    after = [second, _move_to_gpu(["30", 0], "gpu:1"), _report("evicted", ["31", 0])]
    entry = server.run(_prompt({"allocation": ALLOCATION, "mode": "pipeline"}, after=after))
    assert _allocated(entry, api, "20")["gpu:1"] > 0
    models = api.report_json(entry, "32")["models"]
    on_gpu1 = [m for m in models if m["resident"].get("gpu:1")]
    assert len(on_gpu1) == 1 and on_gpu1[0]["resident"]["gpu:1"] == on_gpu1[0]["total_bytes"], models
    assert "made room: 3.20 GiB from SD15 diffusion model" in entry["outputs"]["31"]["text"][0]
    assert _allocated(entry, api, "32")["gpu:0"] == 0, "the evicted split left a part behind"


@ONCE
def test_auto_fills_the_gpus_with_most_free_memory_first(server, api):
    server.run(_prompt(None, after=[{"class_type": "DeviceControl_OffloadToCPU", "inputs": _offload_all()}]))
    entry = server.run(_prompt({"allocation": "auto", "mode": "pipeline"}))
    resident = dict(_model(entry, api, "20")["resident"])
    assert resident.pop("cpu", 0) < 2**20, resident  # 3.20 GiB fit on one 4 GiB GPU with 512 MiB kept free
    assert list(resident) == ["gpu:0"], resident


@ONCE  # the fallback of a device this machine lacks is ours, before ComfyUI sees a device
def test_the_example_workflow_on_a_machine_without_a_gpu_leaves_both_gpus_out_with_a_warning(
    comfy_factory, tmp_path, api
):
    server = comfy_factory(tmp_path / "no-gpu-base")  # no simulated GPU: this machine has only the CPU
    try:
        entry = server.run(api.load_prompt(server, EXAMPLE))
        texts = " ".join(str(text) for output in entry["outputs"].values() for text in output.get("text", ()))
        assert "warning: device 'gpu:0' does not exist" in texts and "device 'gpu:1' does not exist" in texts, texts
        assert set(_model(entry, api, "3")["resident"]) == {"cpu"}  # the model stays in RAM
    finally:
        server.stop()


#: Three GPUs smaller than the SDXL fixture's UNet in fp16 (1.58 GiB: Segmind Vega's depth, an SDXL class).
SMALL_GPUS = "1536MiB,1536MiB,1GiB"


@ONCE
def test_sdxl_larger_than_any_gpu_splits_over_two_of_them_and_over_one_and_ram(servers, api, synthetic_models):
    """SDXL's UNet in fp16 with a LoRA from ComfyUI's stock loader is larger than each simulated GPU (a server of
    its own, the module's last test: a module uses one server at a time): half and half over gpu:0 and gpu:1
    (pipeline), then 600 MB on gpu:2 and the rest in RAM (stream); both give the image of the same model in RAM.
    The same code in every ComfyUI version as SD1.5's UNet (ComfyUI's openaimodel), so it runs once."""
    server = servers("split-small-gpus", SIMULATE_GPU=SMALL_GPUS)
    prompt = api.load_prompt(server, WORKFLOWS / "09 SDXL from separate files - UNet on the GPU.json")
    lora = {"model": ["1", 0], "lora_name": synthetic_models["lora_sdxl"].name, "strength_model": 1.0}
    prompt["39"] = {"class_type": "LoraLoaderModelOnly", "inputs": lora}
    split = {"allocation": "gpu:0=50%, gpu:1=*", "mode": "pipeline"}
    prompt["2"] = {"class_type": "DeviceControl_SplitModel", "inputs": {"model": ["39", 0], **split}}
    again = {"allocation": "gpu:2=600MB, cpu=*", "mode": "stream", "trigger": ["11", 0]}
    prompt["40"] = {"class_type": "DeviceControl_SplitModel", "inputs": {"model": ["39", 0], **again}}
    prompt["41"] = _report("ram", ["40", 0])
    prompt["42"] = {"class_type": "KSampler", "inputs": {**prompt["9"]["inputs"], "model": ["41", 0]}}
    prompt["43"] = {"class_type": "VAEDecode", "inputs": {**prompt["11"]["inputs"], "samples": ["42", 0]}}
    prompt["44"] = {"class_type": "SaveImage", "inputs": {"images": ["43", 0], "filename_prefix": "sdxl_ram"}}
    server.free()
    entry = server.run(prompt)
    two = _model(entry, api, "3")
    total = two["total_bytes"]
    assert total > 1.5 * GiB and "Segmind_Vega" in two["name"], (total, two["name"])
    resident = dict(two["resident"])
    assert resident.pop("cpu", 0) < 2**20 and set(resident) == {"gpu:0", "gpu:1"}, resident
    assert abs(resident["gpu:0"] - total / 2) < 0.1 * total
    ram = _model(entry, api, "41")["resident"]
    assert 0 < ram["gpu:2"] <= 0.6e9 and ram["cpu"] == total - ram["gpu:2"], ram
    assert _allocated(entry, api, "41")["gpu:1"] == 0, "the first split stayed behind"  # (the VAE is on gpu:0)
    # The same graph without the splits: the same fp16 weights, patched the same way, all in RAM. (ComfyUI's
    # stock loader would store them in fp32 on a CPU, where the patched weights round differently.)
    unsplit = {key: node for key, node in prompt.items() if key not in ("2", "40")}
    for report in ("3", "41"):
        unsplit[report]["inputs"]["value"] = ["39", 0]
    server.free()
    one = server.run(unsplit)
    expected = api.image_of(server, one, "13")
    assert np.array_equal(api.image_of(server, one, "44"), expected)
    assert np.array_equal(api.image_of(server, entry, "13"), expected), "pipeline over two GPUs"
    assert np.array_equal(api.image_of(server, entry, "44"), expected), "stream from RAM"
