"""Move To GPU and Offload To CPU in a real ComfyUI on simulated GPUs: books, images, eviction, OOM, cancel."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.integration.executions import watch
from tests.passes import LONG, ONCE
from tools.fixtures.make import SD15_CHECKPOINT
from tools.runtime.server import ComfyError

REPO = Path(__file__).resolve().parents[2]
#: Several full-size models at once: runs while no other tier's module does (tests/server_pool.py).
HOLDS_MODELS = True
MOVE = REPO / "workflows" / "01 Start here - SD1.5 moved to the GPU, then offloaded.json"
LOW_VRAM = REPO / "workflows" / "04 SD1.5 and a LoRA under a 1.5 GB VRAM budget.json"
TWO = REPO / "workflows" / "07 Two checkpoints - the first offloaded before the second.json"
GiB = 1024**3
#: The synthetic SD1.5 UNet in fp32.
UNET_BYTES = 3438091856
REPORT = {"label": "", "devices": "all"}
#: Move/offload cycles per prompt of the drift test, a long check (it runs in the newest tested ComfyUI's pass; the
#: other versions check ComfyUI's side of the books in the shorter tests).
CYCLES = 100


def gpu(entry: dict, api, node: str) -> dict:
    """The simulated GPU's line of a VRAM Report."""
    return next(d for d in api.report_json(entry, node)["devices"] if d["id"] == "gpu:0")


def unet(entry: dict, api, node: str) -> dict | None:
    """The diffusion model's line among the models of a VRAM Report."""
    return next((m for m in api.report_json(entry, node)["models"] if m["component"] == "MODEL"), None)


def text(entry: dict, node: str) -> str:
    return entry["outputs"][node]["text"][0]


@pytest.fixture(scope="module")
def server(servers, server_pool):
    """The module's server; the pool's idle ones are stopped first: several tests hold two full-size SD1.5
    checkpoints in fp32 at once (3.74 GiB each, the pack refuses a load that does not fit in the RAM available)."""
    server_pool.stop_idle()
    return servers("move-8g", SIMULATE_GPU="8GiB")


def test_move_puts_the_unet_on_the_gpu_and_offload_gives_it_all_back(server, api):
    entry = server.run(api.load_prompt(server, MOVE))
    baseline = gpu(entry, api, "2")["torch_allocated"]
    moved = unet(entry, api, "4")
    on_gpu = gpu(entry, api, "4")["torch_allocated"] - baseline
    assert moved["resident"] == {"gpu:0": moved["total_bytes"]}
    assert abs(on_gpu - moved["total_bytes"]) <= 0.01 * moved["total_bytes"]  # the device's own books agree
    assert "3.20 GiB resident on gpu:0" in text(entry, "3")
    assert gpu(entry, api, "10")["torch_allocated"] == baseline  # after Offload To CPU
    assert unet(entry, api, "10") is None  # and ComfyUI no longer lists it as loaded
    assert "3.20 GiB freed" in text(entry, "9")
    assert "loaded SD15 diffusion model: 3.20 GiB: 3.20 GiB resident on gpu:0" in server.log_tail(400)  # as shown


@ONCE  # test_workflows runs each example on every ComfyUI; the ops and patch oracles compare the maths there
def test_every_example_workflow_gives_the_image_of_its_stock_equivalent(server, api):
    for workflow in (MOVE, LOW_VRAM, TWO):
        prompt = api.load_prompt(server, workflow)
        server.forget_outputs()  # an earlier test ran it here: every node must run again for its move to be checked
        entry = server.run(prompt)
        assert api.moves_hold(entry, prompt), f"{workflow.name}: no move was checked against the books"
        ours = api.image_of(server, entry)
        stock = api.image_of(server, server.run(api.stock_equivalent(prompt)))
        assert np.array_equal(ours, stock), f"{workflow.name}: the image differs from ComfyUI's own nodes"


def test_a_budget_streams_the_rest_and_the_sampler_keeps_the_placement(server, api):
    entry = server.run(api.load_prompt(server, LOW_VRAM))
    after_move, after_sampling = unet(entry, api, "4"), unet(entry, api, "10")
    resident = after_move["resident"]["gpu:0"]
    assert after_move["partial"] and resident <= 1.5 * GiB < after_move["total_bytes"]
    # VRAM Report reads ComfyUI's own loaded_size(): the KSampler's load changed nothing. The streamed layers' LoRA
    # factors crossed when they first computed and stay for the next steps, inside the budget.
    assert after_sampling["resident"] == after_move["resident"]
    moved, sampled = gpu(entry, api, "4")["torch_allocated"], gpu(entry, api, "10")["torch_allocated"]
    assert moved <= sampled <= 1.5 * GiB
    assert "streamed" in text(entry, "3") and "budget 1.50 GiB" in text(entry, "3")


def test_the_first_checkpoint_leaves_before_the_second_moves_in(server, api):
    entry = server.run(api.load_prompt(server, TWO))
    models = [m for m in api.report_json(entry, "11")["models"] if m["component"] == "MODEL"]
    on_gpu = [m for m in models if m["resident"].get("gpu:0")]
    assert len(on_gpu) == 1 and gpu(entry, api, "11")["torch_allocated"] == on_gpu[0]["total_bytes"]


def cycles_prompt(count: int, budget: str = "all") -> dict:
    """A loader in RAM, then ``count`` Move To GPU / Offload To CPU pairs in a chain (each move under ``budget``),
    then a report."""
    prompt = {
        "1": {
            "class_type": "DeviceControl_LoadCheckpoint",
            "inputs": {
                "ckpt_name": SD15_CHECKPOINT,
                **dict.fromkeys(("model_device", "clip_device", "vae_device"), "cpu"),
                **dict.fromkeys(("model_dtype", "clip_dtype", "vae_dtype"), "auto"),
            },
        }
    }
    previous = None
    for i in range(count):
        move, off = str(100 + 2 * i), str(101 + 2 * i)
        inputs = {"model": ["1", 0], "device": "gpu:0", "vram_budget": budget, "keep_resident": False}
        if previous:
            inputs["trigger"] = [previous, 0]
        prompt[move] = {"class_type": "DeviceControl_MoveToGPU", "inputs": inputs}
        prompt[off] = {
            "class_type": "DeviceControl_OffloadToCPU",
            "inputs": {
                "model": [move, 0],
                "trigger": [move, 1],
                "mode": "full",
                "free_amount": "1GB",
                "empty_cache": True,
            },
        }
        previous = off
    report = {"label": "after the cycles", "devices": "all"}
    prompt["9"] = {
        "class_type": "DeviceControl_VRAMReport",
        "inputs": report | ({"value": [previous, 0]} if previous else {}),
    }
    return prompt


@LONG
def test_a_hundred_move_offload_cycles_leave_no_drift(server, api):
    # ComfyUI's own caches and history for a long prompt settle over two runs. Each run differs from the others
    # (the budget's spelling: the whole 8 GiB device each time), or ComfyUI would answer it from its cache.
    server.run(cycles_prompt(CYCLES))
    warm = server.run(cycles_prompt(CYCLES, budget="100%"))
    rss = api.report_json(warm, "9")["host"]["process_rss"]
    entry = server.run(cycles_prompt(CYCLES, budget="8GiB"))
    report = api.report_json(entry, "9")
    assert gpu(entry, api, "9")["torch_allocated"] == gpu(warm, api, "9")["torch_allocated"] == 0
    assert report["host"]["process_rss"] < rss * 1.01
    freed = [text(entry, str(101 + 2 * i)) for i in range(CYCLES)]
    assert all("3.20 GiB freed" in line for line in freed)


def test_clip_and_vae_move_too_and_the_image_is_the_same(server, api):
    prompt = api.load_prompt(server, MOVE)
    prompt["20"] = {
        "class_type": "DeviceControl_MoveToGPU",
        "inputs": {"model": ["1", 1], "device": "gpu:0", "vram_budget": "100MB", "keep_resident": False},
    }
    prompt["21"] = {
        "class_type": "DeviceControl_MoveToGPU",
        "inputs": {"model": ["1", 2], "device": "gpu:0", "vram_budget": "150MB", "keep_resident": False},
    }
    prompt["22"] = {"class_type": "DeviceControl_VRAMReport", "inputs": {"value": ["20", 0], **REPORT}}
    prompt["23"] = {"class_type": "DeviceControl_VRAMReport", "inputs": {"value": ["21", 0], **REPORT}}
    for node in ("5", "6"):
        prompt[node]["inputs"]["clip"] = ["22", 0]
    prompt["11"]["inputs"]["vae"] = ["23", 0]
    entry = server.run(prompt)
    assert "streamed" in text(entry, "20") and "streamed" in text(entry, "21")
    assert sorted(api.moves_hold(entry, prompt)) == ["20", "21", "3"]
    assert 0 < api.report_json(entry, "22")["subject"]["resident"]["gpu:0"] <= 100 * 1024**2
    assert 0 < api.report_json(entry, "23")["subject"]["resident"]["gpu:0"] <= 150 * 1024**2
    assert np.array_equal(api.image_of(server, entry), api.image_of(server, server.run(api.stock_equivalent(prompt))))


def test_queued_again_unchanged_every_example_runs_nothing(server, api):
    # The examples this module runs anyway (Move To GPU, a budget with a LoRA, Offload To CPU between two
    # checkpoints); ComfyUI 0.33 would keep their nodes cached from the tests before: forgotten first.
    server.free()
    for workflow in (MOVE, LOW_VRAM, TWO):
        prompt = api.load_prompt(server, workflow)
        first = watch(server, prompt)
        assert first.executed, f"{workflow.name}: the first run executed nothing"
        again = watch(server, prompt)
        assert again.prompt_id, (workflow.name, again.error, again.node_errors)
        assert again.executed == [], f"{workflow.name}: queued again unchanged, it ran {again.executed}"
        assert sorted(again.cached) == sorted(prompt), (workflow.name, again.said)


def test_a_placement_holds_when_the_sampler_runs_again_after_an_offload(server, api):
    prompt = api.load_prompt(server, MOVE)
    server.run(prompt)  # Move To GPU, sample, Offload To CPU (full): the UNet is back in RAM
    prompt["8"]["inputs"]["seed"] += 1
    watched = watch(server, prompt)
    assert {"1", "2", "3", "4"} <= set(watched.cached) and "3" not in watched.executed  # the move is cached
    assert {"8", "9", "10"} <= set(watched.executed)
    entry = server.wait(watched.prompt_id)
    # The sampler's load put the UNet back where Move To GPU placed it: gpu:0 held it while it sampled. (The
    # reports after the loader and the move are cached: 0.28 leaves them out of the history.)
    assert gpu(entry, api, "10")["peak_allocated"] >= UNET_BYTES
    assert "3.20 GiB freed on gpu:0" in text(entry, "9")


@pytest.fixture(scope="module")
def small_server(servers):
    return servers("move-6g", SIMULATE_GPU="6GiB")


def two_models(keep: bool) -> dict:
    """Two checkpoints moved to a 6 GiB GPU, the first with or without keep_resident; a report after both."""
    prompt = cycles_prompt(0)
    prompt["2"] = json.loads(json.dumps(prompt["1"]))
    prompt["2"]["inputs"]["ckpt_name"] = SD15_CHECKPOINT.replace(".safetensors", "_b.safetensors")
    prompt["3"] = {
        "class_type": "DeviceControl_MoveToGPU",
        "inputs": {"model": ["1", 0], "device": "gpu:0", "vram_budget": "all", "keep_resident": keep},
    }
    prompt["4"] = {
        "class_type": "DeviceControl_MoveToGPU",
        "inputs": {
            "model": ["2", 0],
            "device": "gpu:0",
            "vram_budget": "all",
            "keep_resident": False,
            "trigger": ["3", 0],
        },
    }
    prompt["9"]["inputs"]["value"] = ["4", 0]
    return prompt


def test_room_is_made_from_the_least_recently_used_model_unless_it_is_kept(small_server, api):
    def on_gpu(entry: dict) -> list[int]:
        models = [m for m in api.report_json(entry, "9")["models"] if m["component"] == "MODEL"]
        return sorted(m["resident"].get("gpu:0", 0) for m in models)

    total = UNET_BYTES
    evicted = small_server.run(two_models(keep=False))
    assert "made room" in text(evicted, "4") and "streamed" not in text(evicted, "4")
    older, newer = on_gpu(evicted)
    assert newer == total and 0 < older < total  # the first model gave back just what the second needed
    kept = small_server.run(two_models(keep=True))
    assert "streamed" in text(kept, "4") and "could not be freed" in text(kept, "4")
    second, first = on_gpu(kept)
    assert first == total and 0 < second < total  # the second model streams instead of evicting the kept one
    everything = small_server.run(
        {
            "1": {
                "class_type": "DeviceControl_OffloadToCPU",
                "inputs": {"mode": "all models", "free_amount": "1GB", "empty_cache": True},
            },
            "2": {
                "class_type": "DeviceControl_VRAMReport",
                "inputs": {"value": ["1", 0], "label": "", "devices": "all"},
            },
        }
    )
    assert gpu(everything, api, "2")["torch_allocated"] == 0  # the user asked: kept models go too


@pytest.fixture(scope="module")
def crowded_server(servers):
    """4 GiB, of which another program takes 2 GiB without the device reporting it."""
    return servers("move-oom", SIMULATE_GPU="4GiB", SIMULATE_USED_BY_OTHERS="2GiB", SIMULATE_FAULTS="unreported_others")


def test_out_of_memory_lowers_the_budget_and_the_run_completes(crowded_server, api):
    prompt = api.load_prompt(crowded_server, MOVE)
    entry = crowded_server.run(prompt)
    assert "out of memory" in text(entry, "3") and "budget lowered" in text(entry, "3")
    assert unet(entry, api, "4")["partial"] and api.moves_hold(entry, prompt) == ["3"]
    assert 0 < unet(entry, api, "4")["resident"]["gpu:0"] <= 2 * GiB  # what the other program left
    expected = api.image_of(crowded_server, crowded_server.run(api.stock_equivalent(prompt)))
    assert np.array_equal(api.image_of(crowded_server, entry), expected)


@pytest.fixture(scope="module")
def slow_server(servers):
    """Every placement on the simulated GPU takes a few milliseconds: a move lasts long enough to cancel."""
    return servers("move-slow", SIMULATE_GPU="8GiB", SIMULATE_FAULTS="slow_moves")


def test_cancelling_a_move_half_way_leaves_a_model_the_next_run_uses(slow_server, api):
    prompt = api.load_prompt(slow_server, MOVE)
    expected = api.image_of(slow_server, slow_server.run(api.stock_equivalent(prompt)))
    prompt_id = slow_server.queue(prompt)

    def cancel_when_the_move_starts() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "Move To GPU: moving" not in slow_server.log_tail(30):
            time.sleep(0.05)
        time.sleep(0.5)
        slow_server.post("/interrupt", {})

    canceller = threading.Thread(target=cancel_when_the_move_starts)
    canceller.start()
    with pytest.raises(ComfyError):
        slow_server.wait(prompt_id)
    canceller.join()
    assert "onto sim:0 stopped (InterruptProcessingException)" in slow_server.log_tail(200)
    entry = slow_server.run(prompt)
    assert np.array_equal(api.image_of(slow_server, entry), expected)
    assert unet(entry, api, "4")["resident"] == {"gpu:0": unet(entry, api, "4")["total_bytes"]}


@pytest.mark.gpu(
    proves="on a real GPU, Move To GPU takes the UNet's size in VRAM, the next KSampler keeps it there, Offload "
    "To CPU gives it all back, and the image equals ComfyUI's own"
)
def test_a_real_gpu_moves_and_gives_back_vram(synthetic_models, tmp_path_factory, api):
    from tools.runtime.server import ComfyServer

    server = ComfyServer(tmp_path_factory.mktemp("move-cuda"), cpu=False).start()
    try:
        prompt = api.load_prompt(server, MOVE)
        entry = server.run(prompt)
        moved = unet(entry, api, "4")
        grown = gpu(entry, api, "4")["torch_allocated"] - gpu(entry, api, "2")["torch_allocated"]
        assert abs(grown - moved["total_bytes"]) <= 0.01 * moved["total_bytes"]
        assert gpu(entry, api, "10")["torch_allocated"] <= gpu(entry, api, "2")["torch_allocated"]
        stock = server.run(api.stock_equivalent(prompt))
        difference = np.abs(api.image_of(server, entry) - api.image_of(server, stock))
        assert difference.max() <= 2  # GPU kernels may differ in the last bit between two loads
    finally:
        server.stop()
