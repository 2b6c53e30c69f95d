"""Move To GPU and Offload To CPU from every state a user's model can be in, in a real ComfyUI.

A placement must not depend on what ran before: a model never loaded, loaded in full by ComfyUI's own nodes
in an earlier prompt, loaded by Device Control for another device or budget, used by another branch of the
same graph through a clone, a loader output cached from an earlier prompt; from every stock loader
(checkpoint, diffusion model, text encoder, VAE) and ours. Each test asserts the bytes on the simulated GPU
after the node and during sampling (the device's peak while the sampler ran), never only the image: an image
is right when nothing moved. The state ComfyUI leaves after a *low-VRAM* load cannot be produced by a server
on a machine without a GPU; ``test_bridge.py`` starts from it in process.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open

from tests.host_math import same_result
from tools.fixtures.make import SD15_CHECKPOINT, SD15_CLIP_L, SD15_UNET, SD15_VAE, SD35_TINY

GiB = 1024**3
MiB = 1024**2

#: Results every state must reproduce, from the never-loaded state (the reference).
REFERENCE: dict[str, Any] = {}


@pytest.fixture(scope="module")
def server(servers):
    # The sampler's peak is checked against what the device held before it: exact peaks, from counters the pack
    # resets at each report (by default it keeps them, and a peak that sets no new high is only a lower bound).
    return servers("placement-states", SIMULATE_GPU="8GiB,8GiB", PEAKS="reset")


# -- graphs -------------------------------------------------------------------------------------------------


def loaders(source: str) -> tuple[dict[str, Any], list, list, list]:
    """Nodes that load SD1.5 the way ``source`` says, and the MODEL, CLIP and VAE links they give."""
    if source == "checkpoint":
        nodes = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": SD15_CHECKPOINT}}}
        return nodes, ["1", 0], ["1", 1], ["1", 2]
    if source == "ours":
        inputs = {"ckpt_name": SD15_CHECKPOINT}
        inputs |= dict.fromkeys(("model_device", "clip_device", "vae_device"), "cpu")
        inputs |= dict.fromkeys(("model_dtype", "clip_dtype", "vae_dtype"), "auto")
        return {"1": {"class_type": "DeviceControl_LoadCheckpoint", "inputs": inputs}}, ["1", 0], ["1", 1], ["1", 2]
    nodes = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": SD15_UNET, "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": SD15_CLIP_L, "type": "stable_diffusion"}},
        "3": {"class_type": "VAELoader", "inputs": {"vae_name": SD15_VAE}},
    }
    return nodes, ["1", 0], ["2", 0], ["3", 0]


def sampling(model: list, clip: list, latent: dict[str, Any], seed: int) -> dict[str, Any]:
    """Text encoding and one KSampler step (node ``7``) on an empty latent (node ``6``)."""
    return {
        "5": {"class_type": "CLIPTextEncode", "inputs": {"clip": clip, "text": "a lighthouse at dusk"}},
        "6": latent,
        "7": {
            "class_type": "KSampler",
            "inputs": {
                "model": model,
                "positive": ["5", 0],
                "negative": ["5", 0],
                "latent_image": ["6", 0],
                "seed": seed,
                "steps": 1,
                "cfg": 1.0,
                "sampler_name": "euler",
                "scheduler": "normal",
                "denoise": 1.0,
            },
        },
    }


SD15_LATENT = {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}
SD3_LATENT = {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}


def sd15_stock(source: str = "checkpoint", seed: int = 1) -> dict[str, Any]:
    """ComfyUI's own nodes only: load, encode, sample, decode, save."""
    nodes, model, clip, vae = loaders(source)
    nodes |= sampling(model, clip, SD15_LATENT, seed)
    nodes["8"] = {"class_type": "VAEDecode", "inputs": {"samples": ["7", 0], "vae": vae}}
    nodes["9"] = {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "states"}}
    return nodes


def report(value: list, label: str) -> dict[str, Any]:
    return {"class_type": "DeviceControl_VRAMReport", "inputs": {"value": value, "label": label, "devices": "all"}}


def move(value: list, budget: str, device: str = "gpu:0", trigger: list | None = None) -> dict[str, Any]:
    inputs = {"model": value, "device": device, "vram_budget": budget, "keep_resident": False}
    return {"class_type": "DeviceControl_MoveToGPU", "inputs": inputs | ({"trigger": trigger} if trigger else {})}


def with_move(prompt: dict[str, Any], budget: str, device: str = "gpu:0") -> dict[str, Any]:
    """The same graph with Move To GPU (node ``20``) between the diffusion model and the sampler, a VRAM Report
    after the move (``21``, whose passthrough the sampler takes) and one after sampling (``22``)."""
    moved = json.loads(json.dumps(prompt))
    moved["20"] = move(moved["7"]["inputs"]["model"], budget, device)
    moved["21"] = report(["20", 0], "after the move")
    moved["7"]["inputs"]["model"] = ["21", 0]
    moved["22"] = report(["7", 0], "after sampling")
    return moved


def sd3_stock(seed: int = 1) -> dict[str, Any]:
    """The SD3.5-layout model from ComfyUI's own UNETLoader, conditioned by SD1.5's CLIP-L; the latent is saved."""
    nodes = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": SD35_TINY, "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": SD15_CLIP_L, "type": "stable_diffusion"}},
    }
    nodes |= sampling(["1", 0], ["2", 0], SD3_LATENT, seed)
    nodes["9"] = {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": "latents/states"}}
    return nodes


# -- reading results ----------------------------------------------------------------------------------------


def device(entry: dict, api, node: str, device_id: str = "gpu:0") -> dict:
    return next(d for d in api.report_json(entry, node)["devices"] if d["id"] == device_id)


def subject(entry: dict, api, node: str) -> dict:
    return api.report_json(entry, node)["subject"]


def listed(entry: dict, api, node: str, key: str) -> list[dict]:
    """ComfyUI's loaded-model entries for the module tree ``key`` (one at most: no stale entry)."""
    return [m for m in api.report_json(entry, node)["models"] if m["key"] == key]


def summary(entry: dict, node: str = "20") -> str:
    return entry["outputs"][node]["text"][0]


def latent_of(server, entry: dict) -> np.ndarray:
    saved = next(v for v in entry["outputs"].values() if "latents" in v)["latents"][0]
    path = server.base / "output" / saved["subfolder"] / saved["filename"]
    with safe_open(str(path), "pt") as handle:
        return handle.get_tensor("latent_tensor").float().numpy()


def assert_placed(entry: dict, api, budget: int, *, move_node: str = "20", after: str = "21", sampled: str = "22"):
    """The model is where Move To GPU said, within its budget, after the node and while the sampler ran.

    Returns the bytes resident on gpu:0.
    """
    moved = subject(entry, api, after)
    resident = moved["resident"].get("gpu:0", 0)
    assert 0 < resident <= budget, f"{resident} bytes on gpu:0 for a budget of {budget}: {summary(entry, move_node)}"
    assert moved["compute_device"] == "gpu:0" and moved["managed_by"] == "Device Control" and moved["note"] is None
    assert device(entry, api, after)["torch_allocated"] >= resident  # the device's own books hold it
    assert "resident on gpu:0" in summary(entry, move_node)
    assert "before:" in summary(entry, move_node)
    during = listed(entry, api, sampled, moved["key"])
    assert len(during) == 1, f"ComfyUI lists the model {len(during)} times after sampling"
    assert during[0]["resident"].get("gpu:0") == resident, "the sampler's load changed the placement"
    assert during[0]["managed_by"] == "Device Control"
    # While the sampler ran, the weights and the activations it computed were on the device: its peak since the
    # report after the move is above what the device held then (a sampler that ran elsewhere leaves it equal).
    assert device(entry, api, sampled)["peak_allocated"] > device(entry, api, after)["torch_allocated"]
    return resident


# -- SD1.5 from every state -----------------------------------------------------------------------------------


def test_never_loaded_is_the_reference(server, api):
    server.free()
    prompt = with_move(sd15_stock(), "1GB")
    entry = server.run(prompt)
    resident = assert_placed(entry, api, GiB)
    moved = subject(entry, api, "21")
    assert resident < moved["total_bytes"] and "streamed from cpu" in summary(entry)
    assert "before: not loaded" in summary(entry)
    REFERENCE["sd15"] = resident
    assert np.array_equal(api.image_of(server, entry), api.image_of(server, server.run(sd15_stock())))


def test_a_model_comfyui_loaded_in_full_before_is_placed_the_same(server, api):
    server.free()
    server.run(sd15_stock(seed=3))
    entry = server.run(with_move(sd15_stock(seed=4), "1GB"))
    assert assert_placed(entry, api, GiB) == REFERENCE["sd15"]
    assert "before: 3.20 GiB on cpu, loaded by ComfyUI" in summary(entry)
    # The live panel reads the same books: after the run the model is where the move put it.
    key = subject(entry, api, "21")["key"]
    panel = [m for m in server.get("/device_control/snapshot")["report"]["models"] if m["key"] == key]
    assert [m["resident"].get("gpu:0") for m in panel] == [REFERENCE["sd15"]]
    assert panel[0]["managed_by"] == "Device Control" and panel[0]["budget"] == "1.00 GiB"
    assert np.array_equal(api.image_of(server, entry), api.image_of(server, server.run(sd15_stock(seed=4))))


def test_a_cached_loader_output_is_placed_again_after_comfyui_took_it_back(server, api):
    server.free()
    first = server.run(with_move(sd15_stock(seed=5), "1GB"))
    assert assert_placed(first, api, GiB) == REFERENCE["sd15"]
    server.run(sd15_stock(seed=6))  # ComfyUI's own nodes load the cached model their way: back on the CPU
    # Queued again (a new seed, the same Move To GPU): whether ComfyUI answers the move from its cache or runs it
    # again (its cache may keep only the last prompt's nodes), the placement belongs to the model, and the
    # sampler's load puts it back.
    again = server.run(with_move(sd15_stock(seed=7), "1GB"))
    during = listed(again, api, "22", subject(first, api, "21")["key"])
    assert len(during) == 1 and during[0]["managed_by"] == "Device Control", during
    assert during[0]["resident"].get("gpu:0") == REFERENCE["sd15"], "the sampler did not load the placement"


def test_a_model_we_placed_with_another_budget_or_device_takes_the_new_placement(server, api):
    server.free()
    everything = server.run(with_move(sd15_stock(seed=8), "all", device="gpu:1"))
    total = subject(everything, api, "21")["total_bytes"]
    assert subject(everything, api, "21")["resident"] == {"gpu:1": total}
    entry = server.run(with_move(sd15_stock(seed=8), "1GB"))
    assert assert_placed(entry, api, GiB) == REFERENCE["sd15"]
    assert "before: 3.20 GiB on gpu:1, placed by Device Control, budget all" in summary(entry)
    assert device(entry, api, "21", "gpu:1")["torch_allocated"] == 0  # it left the first device entirely
    smaller = server.run(with_move(sd15_stock(seed=8), "600MB"))  # the same device, another budget
    assert assert_placed(smaller, api, 600 * MiB) < REFERENCE["sd15"]


def test_two_moves_in_one_graph_each_hold_at_their_point(server, api):
    """Move To GPU (all) then Move To GPU (1 GB) on the same model in one prompt; the sampler uses the second."""
    server.free()
    prompt = with_move(sd15_stock(seed=9), "1GB")
    prompt["30"] = move(["1", 0], "all")
    prompt["31"] = report(["30", 0], "after the first move")
    prompt["20"]["inputs"]["trigger"] = ["31", 0]
    entry = server.run(prompt)
    first = subject(entry, api, "31")
    assert first["resident"] == {"gpu:0": first["total_bytes"]}
    assert assert_placed(entry, api, GiB) == REFERENCE["sd15"]


def test_a_clone_used_by_another_branch_does_not_undo_the_placement(server, api):
    """Branch A samples with the loader's model on ComfyUI's own terms between Move To GPU and branch B's
    sampler; B's sampler still computes with the placed model."""
    server.free()
    prompt = with_move(sd15_stock(seed=10), "1GB")
    prompt["40"] = json.loads(json.dumps(prompt["7"]))  # branch A: the loader's model, after the move
    prompt["40"]["inputs"].update(model=["1", 0], latent_image=["20", 1], seed=11)
    prompt["20"]["inputs"]["trigger"] = ["6", 0]
    prompt["41"] = report(["40", 0], "after branch A")
    prompt["7"]["inputs"]["latent_image"] = ["41", 0]  # branch B samples after A
    entry = server.run(prompt)
    taken = listed(entry, api, "41", subject(entry, api, "21")["key"])
    assert taken and taken[0]["resident"].get("gpu:0", 0) == 0, "branch A did not load the model its own way"
    assert assert_placed(entry, api, GiB) == REFERENCE["sd15"]
    stock = api.stock_equivalent(prompt)
    assert np.array_equal(api.image_of(server, entry), api.image_of(server, server.run(stock)))


def test_our_loader_s_model_is_placed_the_same(server, api):
    server.free()
    server.run(sd15_stock("ours", seed=12))
    entry = server.run(with_move(sd15_stock("ours", seed=13), "1GB"))
    assert assert_placed(entry, api, GiB) == REFERENCE["sd15"]


def test_every_stock_split_loader_s_model_is_placed(server, api):
    """UNETLoader, CLIPLoader and VAELoader, after a stock run loaded all three."""
    server.free()
    server.run(sd15_stock("split", seed=14))
    prompt = with_move(sd15_stock("split", seed=15), "1GB")
    prompt["50"] = move(["2", 0], "100MB")
    prompt["51"] = report(["50", 0], "text encoder after the move")
    prompt["5"]["inputs"]["clip"] = ["51", 0]
    prompt["20"]["inputs"]["trigger"] = ["51", 0]  # in this order: text encoder, diffusion model, sampler, VAE
    prompt["52"] = move(["3", 0], "100MB", trigger=["22", 0])
    prompt["53"] = report(["52", 0], "VAE after the move")
    prompt["8"]["inputs"]["vae"] = ["53", 0]
    entry = server.run(prompt)
    assert assert_placed(entry, api, GiB) == REFERENCE["sd15"]
    for node, report_node in (("50", "51"), ("52", "53")):
        moved = subject(entry, api, report_node)
        assert 0 < moved["resident"]["gpu:0"] <= 100 * MiB and moved["managed_by"] == "Device Control"
        assert "resident on gpu:0" in summary(entry, node) and "loaded by ComfyUI" in summary(entry, node)
    stock = sd15_stock("split", seed=15)
    assert np.array_equal(api.image_of(server, entry), api.image_of(server, server.run(stock)))


# -- a DiT family (SD3.5 layout) from the stock UNETLoader ---------------------------------------------------


def test_a_dit_from_the_stock_unet_loader_is_placed_from_any_state(server, api):
    server.free()
    budget = 100 * MiB
    fresh = server.run(with_move(sd3_stock(seed=1), "100MB"))
    reference = assert_placed(fresh, api, budget)
    assert reference < subject(fresh, api, "21")["total_bytes"] and "streamed from cpu" in summary(fresh)
    stock = server.run(sd3_stock(seed=2))  # ComfyUI's own sampler loads it its way
    again = server.run(with_move(sd3_stock(seed=2), "100MB"))
    assert assert_placed(again, api, budget) == reference
    assert "loaded by ComfyUI" in summary(again)
    assert same_result(latent_of(server, again), latent_of(server, stock))
    branch = with_move(sd3_stock(seed=3), "100MB")  # another branch samples with the stock model in between
    branch["40"] = json.loads(json.dumps(branch["7"]))
    branch["40"]["inputs"].update(model=["1", 0], latent_image=["20", 1], seed=4)
    branch["20"]["inputs"]["trigger"] = ["6", 0]
    branch["41"] = report(["40", 0], "after branch A")
    branch["7"]["inputs"]["latent_image"] = ["41", 0]
    entry = server.run(branch)
    assert assert_placed(entry, api, budget) == reference


# -- Offload To CPU from the same states -----------------------------------------------------------------------


def offload(value: list, trigger: list, mode: str = "full") -> dict[str, Any]:
    inputs = {"model": value, "trigger": trigger, "mode": mode, "free_amount": "1GB", "empty_cache": True}
    return {"class_type": "DeviceControl_OffloadToCPU", "inputs": inputs}


def test_offload_names_the_device_the_bytes_left(server, api):
    server.free()
    prompt = with_move(sd15_stock(seed=20), "1GB")
    prompt["60"] = offload(["20", 0], ["22", 0])
    prompt["61"] = report(["60", 0], "after the offload")
    prompt["8"]["inputs"]["samples"] = ["61", 0]
    entry = server.run(prompt)
    resident = assert_placed(entry, api, GiB)
    text = summary(entry, "60")
    assert "freed (gpu:0 " in text and "freed on gpu:0" in text and "on cpu" not in text
    assert device(entry, api, "61")["torch_allocated"] == 0
    assert REFERENCE["sd15"] == resident


def test_offload_of_a_model_comfyui_keeps_in_ram_frees_nothing_and_says_so(server, api):
    server.free()
    prompt = sd15_stock(seed=21)
    prompt["60"] = offload(["1", 0], ["7", 0])
    prompt["8"]["inputs"]["samples"] = ["60", 0]
    entry = server.run(prompt)
    text = summary(entry, "60")
    assert text.startswith("Offload To CPU (full): 0 B freed") and "in RAM already" in text


def test_offload_after_comfyui_took_a_placed_model_back_frees_nothing_on_the_gpu(server, api):
    server.free()
    placed = server.run(with_move(sd15_stock(seed=22), "1GB"))
    assert_placed(placed, api, GiB)
    server.run(sd15_stock(seed=23))  # ComfyUI's own nodes load it their way: the GPU holds nothing of it now
    prompt = sd15_stock(seed=24)
    prompt["60"] = offload(["1", 0], ["7", 0])
    prompt["61"] = report(["60", 0], "after the offload")
    prompt["8"]["inputs"]["samples"] = ["61", 0]
    entry = server.run(prompt)
    assert "gpu:0" not in summary(entry, "60") and "in RAM already" in summary(entry, "60")
    assert device(entry, api, "61")["torch_allocated"] == 0
