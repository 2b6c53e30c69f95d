"""Move To GPU, Offload To CPU and the VRAM Report on the models a workflow loads beside its checkpoint, through a
real ComfyUI on a simulated GPU: a ControlNet, a CLIP vision model, a model patch, GLIGEN and an upscale model, each
from ComfyUI's own loader (``tools/fixtures/model_types.py``).

Each move is checked against the bytes a VRAM Report measures after it (``moves_hold``), and again after ComfyUI's
own node used the model (the sampler with the ControlNet applied, CLIP Vision Encode, the upscale node), which
must keep the placement rather than load the model its own way.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from tests.integration.executions import watch
from tools.fixtures.make import SD15_CHECKPOINT
from tools.fixtures.model_types import FILES, MISPLACED
from tools.runtime.provision import DEFAULT_VERSION
from tools.runtime.server import ComfyError

MiB = 1024**2
#: ComfyUI gives an upscale model a ModelPatcher from 0.33 (0.3.75 is older than 0.28).
UPSCALE_PATCHER = tuple(int(part) for part in DEFAULT_VERSION.split(".")[:2]) >= (0, 33)
REPORT = {"label": "", "devices": "all"}
#: Each fixture's type on a wire, and what reports call it.
KINDS = {"controlnet": "CONTROL_NET", "clip_vision": "CLIP_VISION", "model_patch": "MODEL_PATCH", "gligen": "GLIGEN"}
KIND_NOUNS = {
    "CONTROL_NET": "ControlNet",
    "CLIP_VISION": "CLIP vision model",
    "MODEL_PATCH": "model patch",
    "GLIGEN": "GLIGEN model",
}
NAMES = {kind: name for kind, (_folder, name) in FILES.items()}
#: ComfyUI's loader of each kind: its class and the input naming the file.
LOADERS = {
    "controlnet": ("ControlNetLoader", "control_net_name"),
    "clip_vision": ("CLIPVisionLoader", "clip_name"),
    "model_patch": ("ModelPatchLoader", "name"),
    "gligen": ("GLIGENLoader", "gligen_name"),
    "upscale_model": ("UpscaleModelLoader", "model_name"),
}


@pytest.fixture(scope="module")
def server(servers):
    return servers("model-types-2x8g", SIMULATE_GPU="8GiB,8GiB")


def loader(kind: str) -> dict[str, Any]:
    node, name_input = LOADERS[kind]
    return {"class_type": node, "inputs": {name_input: NAMES[kind]}}


def moved(source: list[Any], budget: str = "all", device: str = "gpu:0") -> dict[str, Any]:
    inputs = {"model": source, "device": device, "vram_budget": budget, "keep_resident": False}
    return {"class_type": "DeviceControl_MoveToGPU", "inputs": inputs}


def report(value: list[Any]) -> dict[str, Any]:
    return {"class_type": "DeviceControl_VRAMReport", "inputs": {"value": value, **REPORT}}


def subject(api, entry: dict, node: str) -> dict:
    return api.report_json(entry, node)["subject"]


def held_on_gpu(api, entry: dict, node: str, name: str) -> int:
    """The bytes on gpu:0 of the loaded model named ``name``, in the models list of report ``node`` (0 when ComfyUI
    holds no such model)."""
    models = [m for m in api.report_json(entry, node)["models"] if m["name"] == name]
    return sum(m["resident"].get("gpu:0", 0) for m in models)


@pytest.mark.parametrize("kind", ["clip_vision", "model_patch", "gligen"])
def test_a_model_of_each_kind_moves_to_the_gpu_whole_and_offload_gives_it_back(server, api, kind):
    prompt = {
        "1": loader(kind),
        "2": moved(["1", 0]),
        "3": report(["2", 0]),
        "4": {
            "class_type": "DeviceControl_OffloadToCPU",
            "inputs": {"model": ["3", 0], "mode": "full", "free_amount": "2GB", "empty_cache": True},
        },
        "5": report(["4", 0]),
    }
    entry = server.run(prompt)
    assert api.moves_hold(entry, prompt) == ["2"]
    placed = subject(api, entry, "3")
    assert placed["resident"] == {"gpu:0": placed["total_bytes"]} and placed["total_bytes"] > MiB
    assert (placed["component"], placed["name"]) == (KINDS[kind], KIND_NOUNS[KINDS[kind]])
    assert held_on_gpu(api, entry, "5", placed["name"]) == 0


def test_a_clip_vision_model_under_a_budget_streams_and_its_encode_keeps_the_placement(server, api):
    prompt = {
        "1": loader("clip_vision"),
        "2": moved(["1", 0], "100MB"),
        "3": report(["2", 0]),
        "4": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 8421504}},
        "5": {
            "class_type": "CLIPVisionEncode",
            "inputs": {"clip_vision": ["3", 0], "image": ["4", 0], "crop": "none"},
        },
        "6": report(["5", 0]),
    }
    entry = server.run(prompt)
    assert "streamed" in entry["outputs"]["2"]["text"][0]
    assert api.moves_hold(entry, prompt) == ["2"]
    placed = subject(api, entry, "3")["resident"]["gpu:0"]
    assert 0 < placed <= 100 * MiB
    assert held_on_gpu(api, entry, "6", subject(api, entry, "3")["name"]) == placed  # the encode kept it so


def sampled_with_controlnet(control: list[Any], model: list[Any]) -> dict[str, Any]:
    """SD1.5 sampling one step with the ControlNet at ``control`` applied, the diffusion model taken from ``model``,
    the latent reported (node 22), decoded and saved."""
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": SD15_CHECKPOINT}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a cat", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["1", 1]}},
        "13": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 8421504}},
        "14": {
            "class_type": "ControlNetApplyAdvanced",
            "inputs": {
                "positive": ["2", 0],
                "negative": ["3", 0],
                "control_net": control,
                "image": ["13", 0],
                "strength": 1.0,
                "start_percent": 0.0,
                "end_percent": 1.0,
            },
        },
        "20": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "21": {
            "class_type": "KSampler",
            "inputs": {
                "model": model,
                "positive": ["14", 0],
                "negative": ["14", 1],
                "latent_image": ["20", 0],
                "seed": 1,
                "steps": 1,
                "cfg": 1.0,
                "sampler_name": "euler",
                "scheduler": "normal",
                "denoise": 1.0,
            },
        },
        "22": report(["21", 0]),
        "23": {"class_type": "VAEDecode", "inputs": {"samples": ["22", 0], "vae": ["1", 2]}},
        "24": {"class_type": "SaveImage", "inputs": {"images": ["23", 0], "filename_prefix": "controlnet"}},
    }


def test_a_controlnet_moves_to_the_gpu_and_the_sampler_keeps_it_there(server, api):
    prompt = {
        **sampled_with_controlnet(["12", 0], ["1", 0]),
        "10": loader("controlnet"),
        "11": moved(["10", 0]),
        "12": report(["11", 0]),
    }
    entry = server.run(prompt)
    assert api.moves_hold(entry, prompt) == ["11"]
    placed = subject(api, entry, "12")
    assert placed["resident"] == {"gpu:0": placed["total_bytes"]}
    assert held_on_gpu(api, entry, "22", placed["name"]) == placed["total_bytes"]  # loaded with the UNet, kept


@pytest.mark.parametrize("budget", ["all", "400MB"], ids=["whole", "under a budget"])
def test_a_controlnet_on_the_second_gpu_serves_its_diffusion_model_on_the_first_with_the_stock_image(
    server, api, budget
):
    # ComfyUI calls the ControlNet with the UNet's tensors: they cross to gpu:1 and its residuals come back.
    prompt = {
        **sampled_with_controlnet(["12", 0], ["31", 0]),
        "10": loader("controlnet"),
        "11": moved(["10", 0], budget, device="gpu:1"),
        "12": report(["11", 0]),
        "30": moved(["1", 0]),
        "31": report(["30", 0]),
    }
    server.forget_outputs()
    stock = server.run(api.stock_equivalent(prompt))  # first: ComfyUI's own load of the same modules, on its device
    entry = server.run(prompt)
    summary = entry["outputs"]["11"]["text"][0]
    assert "before: " in summary and "loaded by ComfyUI" in summary, summary  # taken over from the stock run
    assert sorted(api.moves_hold(entry, prompt)) == ["11", "30"]
    control, unet = subject(api, entry, "12"), subject(api, entry, "31")
    placed = control["resident"]["gpu:1"]
    if budget == "all":
        assert control["resident"] == {"gpu:1": control["total_bytes"]}
    else:  # the rest streams from RAM to gpu:1 at each call, through the same engine as a UNet's
        assert 0 < placed <= 400 * MiB and control["resident"] == {
            "gpu:1": placed,
            "cpu": control["total_bytes"] - placed,
        }
        assert "streamed" in summary, summary
    after = {m["name"]: m["resident"] for m in api.report_json(entry, "22")["models"]}
    assert after["ControlNet"] == control["resident"]  # the sampler kept each where it was placed
    assert after[unet["name"]] == {"gpu:0": unet["total_bytes"]}
    assert np.array_equal(api.image_of(server, entry, "24"), api.image_of(server, stock, "24"))


def test_an_upscale_model_is_placed_where_comfyui_gives_it_a_patcher_and_refused_with_the_reason_elsewhere(server, api):
    prompt = {
        "1": loader("upscale_model"),
        "2": moved(["1", 0]),
        "3": report(["2", 0]),
        "4": {"class_type": "EmptyImage", "inputs": {"width": 32, "height": 32, "batch_size": 1, "color": 8421504}},
        "5": {"class_type": "ImageUpscaleWithModel", "inputs": {"upscale_model": ["3", 0], "image": ["4", 0]}},
        "6": report(["5", 0]),
        "7": {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": "upscaled"}},
    }
    if not UPSCALE_PATCHER:
        with pytest.raises(ComfyError, match="gives an upscale model no ModelPatcher"):
            server.run(prompt)
        return
    server.forget_outputs()
    stock = server.run(api.stock_equivalent(prompt))  # ComfyUI's own upscale of the same image, the oracle
    entry = server.run(prompt)
    assert api.moves_hold(entry, prompt) == ["2"]
    placed = subject(api, entry, "3")
    assert placed["resident"] == {"gpu:0": placed["total_bytes"]}
    assert (placed["component"], placed["name"]) == ("UPSCALE_MODEL", "upscale model")
    assert held_on_gpu(api, entry, "6", placed["name"]) == placed["total_bytes"]
    ours, theirs = api.image_of(server, entry, "7"), api.image_of(server, stock, "7")
    assert ours.shape == (64, 64, 3) and np.array_equal(ours, theirs) and ours.std() > 1  # the image, not flat


@pytest.mark.parametrize("kind", ["controlnet", "clip_vision", "model_patch", "gligen"])
def test_a_model_of_each_kind_moves_from_each_state_a_placement_leaves_it_in(server, api, kind):
    # Partly on gpu:1 (whole where it fits 400 MB), then whole on gpu:0, then offloaded, then on gpu:0 again: each
    # time only where it was put; queued again unchanged, nothing runs and it stays there (ComfyUI's cache).
    offload = {"mode": "full", "free_amount": "2GB", "empty_cache": True}
    prompt = {
        "1": loader(kind),
        "2": moved(["1", 0], "400MB", device="gpu:1"),
        "3": report(["2", 0]),
        "4": moved(["3", 0]),
        "5": report(["4", 0]),
        "6": {"class_type": "DeviceControl_OffloadToCPU", "inputs": {"model": ["5", 0], **offload}},
        "7": report(["6", 0]),
        "8": {**moved(["5", 0]), "inputs": {**moved(["5", 0])["inputs"], "trigger": ["7", 0]}},
        "9": report(["8", 0]),
    }
    server.forget_outputs()
    entry = server.run(prompt)
    assert sorted(api.moves_hold(entry, prompt)) == ["2", "4", "8"]
    total, noun = subject(api, entry, "3")["total_bytes"], KIND_NOUNS[KINDS[kind]]
    assert 0 < subject(api, entry, "3")["resident"]["gpu:1"] <= 400 * MiB
    listed = {
        node: [m["resident"] for m in api.report_json(entry, node)["models"] if m["name"] == noun]
        for node in ("5", "7", "9")
    }
    assert listed == {"5": [{"gpu:0": total}], "7": [], "9": [{"gpu:0": total}]}, listed
    again = watch(server, prompt)
    assert again.prompt_id and again.executed == [], again.executed
    rows = [m["resident"] for m in server.get("/device_control/snapshot")["report"]["models"] if m["name"] == noun]
    assert rows == [{"gpu:0": total}], rows


def test_split_model_refuses_a_controlnet_with_what_to_do(server, api):
    # ComfyUI refuses the link by its type; through a VRAM Report's passthrough (any type) the node does.
    prompt = {
        "1": loader("controlnet"),
        "2": report(["1", 0]),
        "3": {
            "class_type": "DeviceControl_SplitModel",
            "inputs": {"model": ["2", 0], "allocation": "gpu:0=50%,cpu=*", "mode": "stream"},
        },
        "4": report(["3", 0]),
    }
    with pytest.raises(ComfyError, match="cannot be split: Split Model shares out a MODEL or a CLIP"):
        server.run(prompt)


def test_a_clip_vision_model_comfyui_loaded_and_kept_is_taken_over_by_the_move(server, api):
    # The loader's output is ComfyUI's cached one in the second prompt, loaded by its own CLIP Vision Encode before.
    image = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 255}}
    stock = {
        "1": loader("clip_vision"),
        "4": image,
        "5": {"class_type": "CLIPVisionEncode", "inputs": {"clip_vision": ["1", 0], "image": ["4", 0], "crop": "none"}},
        "6": report(["5", 0]),
    }
    before = server.run(stock)
    name = next(m["name"] for m in api.report_json(before, "6")["models"] if m["component"] == "CLIP_VISION")
    held = next(m for m in api.report_json(before, "6")["models"] if m["name"] == name)
    assert held["managed_by"] != "Device Control" and held["resident"].get("gpu:0", 0) == 0, held
    prompt = {"1": loader("clip_vision"), "2": moved(["1", 0], "200MB"), "3": report(["2", 0])}
    entry = server.run(prompt)
    assert "loaded by ComfyUI" in entry["outputs"]["2"]["text"][0]  # where it was before, in the summary
    assert api.moves_hold(entry, prompt) == ["2"]
    assert 0 < subject(api, entry, "3")["resident"]["gpu:0"] <= 200 * MiB
    listed = [m for m in api.report_json(entry, "3")["models"] if m["name"] == name]
    assert len(listed) == 1 and listed[0]["managed_by"] == "Device Control", listed  # one entry in ComfyUI's list


def test_the_panel_and_the_run_profile_name_a_moved_controlnet_and_its_offload_button_frees_it(server, api):
    prompt = {"1": loader("controlnet"), "2": moved(["1", 0]), "3": report(["2", 0])}
    server.forget_outputs()  # answered from the cache, the move would not run: nothing to profile or offload
    prompt_id = server.queue(prompt)
    entry = server.wait(prompt_id)
    placed = subject(api, entry, "3")
    rows = [m for m in server.get("/device_control/snapshot")["report"]["models"] if m["component"] == "CONTROL_NET"]
    assert [(m["name"], m["resident"]) for m in rows] == [("ControlNet", {"gpu:0": placed["total_bytes"]})]
    move = next(n for n in server.get(f"/device_control/profile?prompt_id={prompt_id}")["nodes"] if n["node"] == "2")
    events = [(e["kind"], e["model"], e["after"].get("gpu:0")) for e in move["events"]]
    assert events == [("loaded", "ControlNet", placed["total_bytes"])]
    answer = server.post("/device_control/offload", {"model": rows[0]["key"]})  # the row's Offload button
    assert answer == {"offloaded": 1, "freed": {"gpu:0": placed["total_bytes"]}}
    assert all(m["component"] != "CONTROL_NET" for m in server.get("/device_control/snapshot")["report"]["models"])


def loaded_with_device(kind: str, device: str, budget: str = "all", dtype: str = "auto") -> dict[str, Any]:
    """Our loader of ``kind`` (``Load ControlNet / CLIP Vision / Model Patch With Device``) on its fixture."""
    node, name_input = {
        "controlnet": ("DeviceControl_LoadControlNet", "control_net_name"),
        "clip_vision": ("DeviceControl_LoadCLIPVision", "clip_name"),
        "model_patch": ("DeviceControl_LoadModelPatch", "name"),
    }[kind]
    inputs = {name_input: NAMES[kind], "device": device, "vram_budget": budget, "dtype": dtype}
    return {"class_type": node, "inputs": inputs}


def test_load_controlnet_with_device_on_the_second_gpu_under_a_budget_gives_the_stock_image(server, api):
    prompt = {
        **sampled_with_controlnet(["12", 0], ["31", 0]),
        "11": loaded_with_device("controlnet", "gpu:1", "400MB"),
        "12": report(["11", 0]),
        "30": moved(["1", 0]),
        "31": report(["30", 0]),
    }
    server.forget_outputs()
    stock = server.run(api.stock_equivalent(prompt))  # ComfyUI's Load ControlNet Model: the oracle
    entry = server.run(prompt)
    summary = entry["outputs"]["11"]["text"][0]
    assert summary.startswith(f"ControlNet, SD1.x from {NAMES['controlnet']}: "), summary
    control = subject(api, entry, "12")
    placed = control["resident"]["gpu:1"]
    assert 0 < placed <= 400 * MiB and control["resident"] == {"gpu:1": placed, "cpu": control["total_bytes"] - placed}
    after = {m["name"]: m["resident"] for m in api.report_json(entry, "22")["models"]}
    assert after["ControlNet"] == control["resident"]  # the sampler kept it where the loader put it
    assert np.array_equal(api.image_of(server, entry, "24"), api.image_of(server, stock, "24"))


@pytest.mark.parametrize("kind", ["clip_vision", "model_patch"])
def test_load_clip_vision_and_model_patch_with_device_place_their_model_in_the_dtype_chosen(server, api, kind):
    # The same file in fp32 and in fp16: twice the bytes, each whole on gpu:0 (their layers cast their weights to
    # the input's dtype, as ComfyUI builds them, whatever dtype ComfyUI's own loader gives them here).
    prompt = {
        "1": loaded_with_device(kind, "gpu:0", dtype="fp32"),
        "2": report(["1", 0]),
        "3": {
            "class_type": "DeviceControl_OffloadToCPU",
            "inputs": {"model": ["2", 0], "mode": "full", "free_amount": "2GB", "empty_cache": True},
        },
        "4": loaded_with_device(kind, "gpu:0", dtype="fp16"),
        "5": report(["4", 0]),
    }
    entry = server.run(prompt)
    wide, narrow = subject(api, entry, "2"), subject(api, entry, "5")
    for placed, dtype, node in ((wide, "float32", "1"), (narrow, "float16", "4")):
        assert placed["resident"] == {"gpu:0": placed["total_bytes"]}
        assert (placed["component"], placed["name"]) == (KINDS[kind], KIND_NOUNS[KINDS[kind]])
        assert f"stored as {dtype}" in entry["outputs"][node]["text"][0]
    assert wide["total_bytes"] == 2 * narrow["total_bytes"] > MiB


def test_upscale_image_with_device_keeps_the_model_on_the_second_gpu_and_gives_the_stock_image(server, api):
    # On every ComfyUI: before 0.33 ComfyUI's own upscale node moves the model to its device and back at each use.
    prompt = {
        "1": loader("upscale_model"),
        "2": {"class_type": "LoadImage", "inputs": {"image": "example.png"}},
        "3": {
            "class_type": "ImageScale",
            "inputs": {"image": ["2", 0], "upscale_method": "area", "width": 96, "height": 80, "crop": "disabled"},
        },
        "4": {
            "class_type": "DeviceControl_UpscaleImage",
            "inputs": {"upscale_model": ["1", 0], "image": ["3", 0], "device": "gpu:1"},
        },
        "5": report(["4", 0]),
        "6": {"class_type": "SaveImage", "inputs": {"images": ["5", 0], "filename_prefix": "upscaled"}},
    }
    server.forget_outputs()
    stock = server.run(api.stock_equivalent(prompt))  # ComfyUI's Upscale Image (using Model): the oracle
    entry = server.run(prompt)
    summary = entry["outputs"]["4"]["text"][0]
    assert summary.startswith("upscaled 96x80 to 192x160 (x2)"), summary
    models = [m for m in api.report_json(entry, "5")["models"] if m["name"] == "upscale model"]
    assert len(models) == 1, api.report_json(entry, "5")["models"]  # kept where it was placed after the upscale
    assert models[0]["resident"] == {"gpu:1": models[0]["total_bytes"]} and "resident on gpu:1" in summary
    ours, theirs = api.image_of(server, entry, "6"), api.image_of(server, stock, "6")
    assert ours.shape == (160, 192, 3) and np.array_equal(ours, theirs) and ours.std() > 1  # the image, not flat


@pytest.mark.parametrize("kind", ["gligen", "model_patch"])
def test_a_patch_placed_apart_from_the_diffusion_model_it_computes_inside_is_refused_when_queued(server, api, kind):
    """GLIGEN on gpu:1 reaches the sampler of a UNet on gpu:0 through its conditioning; a model patch on gpu:1 is
    applied to it: ComfyUI would call either from inside the UNet's steps with the UNet's tensors."""
    prompt = sampled_with_controlnet(["13", 0], ["31", 0])  # the ControlNet's place taken by an image below
    prompt.pop("14")
    prompt["21"]["inputs"].update(positive=["2", 0], negative=["3", 0])
    prompt.update({"10": loader(kind), "11": moved(["10", 0], device="gpu:1"), "30": moved(["1", 0])})
    prompt["31"] = report(["30", 0])
    if kind == "gligen":
        box = {"text": "a cat", "width": 64, "height": 64, "x": 0, "y": 0}
        inputs = {"conditioning_to": ["2", 0], "clip": ["1", 1], "gligen_textbox_model": ["11", 0], **box}
        prompt["15"] = {"class_type": "GLIGENTextBoxApply", "inputs": inputs}
        prompt["21"]["inputs"]["positive"] = ["15", 0]
    else:
        prompt["16"] = {"class_type": "CLIPVisionLoader", "inputs": {"clip_name": NAMES["clip_vision"]}}
        encode = {"clip_vision": ["16", 0], "image": ["13", 0], "crop": "none"}
        prompt["17"] = {"class_type": "CLIPVisionEncode", "inputs": encode}
        uso = {"model": ["31", 0], "model_patch": ["11", 0], "clip_vision_output": ["17", 0]}
        prompt["15"] = {"class_type": "USOStyleReference", "inputs": uso}
        prompt["21"]["inputs"]["model"] = ["15", 0]
    watched = watch(server, prompt)
    assert not watched.prompt_id and not watched.executed, "the prompt ran"
    [error] = watched.node_errors["11"]["errors"]
    noun = KIND_NOUNS[KINDS[kind]]
    said = f"this {noun} is placed on gpu:1, but the diffusion model it computes inside (from node 1) is on gpu:0"
    assert error["extra_info"]["input_name"] == "device" and said in error["details"], error
    assert error["details"].endswith("Place it on gpu:0 too.")


def test_gligen_placed_beside_its_unet_gives_the_stock_image_which_its_box_changes(server, api):
    """ComfyUI's GLIGENLoader and GLIGEN Textbox Apply as the oracle: SD1.5's GLIGEN moved to gpu:0 beside the
    UNet moved there gives the image of the same graph without a node of ours, and the sampler keeps it there;
    without the box, another image (the box reached the UNet's steps)."""
    prompt = sampled_with_controlnet(["13", 0], ["31", 0])  # the ControlNet's place taken by GLIGEN's box
    prompt.pop("14")
    box = {"text": "a cat", "width": 32, "height": 32, "x": 16, "y": 16}
    inputs = {"conditioning_to": ["2", 0], "clip": ["1", 1], "gligen_textbox_model": ["12", 0], **box}
    prompt.update({"10": loader("gligen"), "11": moved(["10", 0]), "12": report(["11", 0]), "30": moved(["1", 0])})
    prompt.update({"15": {"class_type": "GLIGENTextBoxApply", "inputs": inputs}, "31": report(["30", 0])})
    prompt["21"]["inputs"].update(positive=["15", 0], negative=["3", 0])
    server.forget_outputs()
    stock = server.run(api.stock_equivalent(prompt))
    entry = server.run(prompt)
    assert sorted(api.moves_hold(entry, prompt)) == ["11", "30"]
    placed = subject(api, entry, "12")
    assert placed["resident"] == {"gpu:0": placed["total_bytes"]} and placed["total_bytes"] > 400 * MiB
    assert held_on_gpu(api, entry, "22", placed["name"]) == placed["total_bytes"]  # the sampler kept it there
    ours = api.image_of(server, entry, "24")
    assert np.array_equal(ours, api.image_of(server, stock, "24")) and ours.std() > 1
    plain = {key: node for key, node in prompt.items() if key not in ("10", "11", "12", "15")}
    plain["21"] = {**prompt["21"], "inputs": {**prompt["21"]["inputs"], "positive": ["2", 0]}}
    assert not np.array_equal(ours, api.image_of(server, server.run(plain), "24"))


def test_a_file_of_another_kind_is_refused_by_the_loader_before_anything_loads(server, api):
    """A CLIP vision file in the controlnet folder (the name the loader is given): named, with the node that
    takes it; nothing loaded."""
    before = server.get("/device_control/snapshot")["report"]["models"]
    prompt = {"1": loaded_with_device("controlnet", "gpu:0"), "2": report(["1", 0])}
    prompt["1"]["inputs"]["control_net_name"] = MISPLACED
    refusal = "is a CLIP vision model (CLIP vision ViT-L), not a ControlNet; load it with Load CLIP Vision With Device"
    with pytest.raises(ComfyError, match=re.escape(refusal)):
        server.run(prompt)
    after = server.get("/device_control/snapshot")["report"]["models"]
    assert all(model in before for model in after)  # none loaded (the run may have let an earlier one go)


@pytest.fixture(scope="module")
def small_server(servers):
    # Last in the module: taking it gives the module's first server back to the pool.
    return servers("model-types-4g", SIMULATE_GPU="4GiB")


def test_a_controlnet_and_its_unet_under_budgets_on_a_4gb_gpu_both_hold_through_sampling(small_server, api):
    # 2.5 GB of a 3.2 GB UNet and 800 MB of a 1.35 GB ControlNet: ComfyUI loads both at each step, each in its budget.
    prompt = {
        **sampled_with_controlnet(["12", 0], ["31", 0]),
        "10": loader("controlnet"),
        "11": moved(["10", 0], "800MB"),
        "12": report(["11", 0]),
        "30": moved(["1", 0], "2.5GB"),
        "31": report(["30", 0]),
    }
    entry = small_server.run(prompt)
    assert sorted(api.moves_hold(entry, prompt)) == ["11", "30"]
    after = {m["name"]: m["resident"] for m in api.report_json(entry, "22")["models"]}
    for node, budget in (("12", 800 * MiB), ("31", 2.5 * 1024 * MiB)):
        placed = subject(api, entry, node)
        assert 0 < after[placed["name"]]["gpu:0"] == placed["resident"]["gpu:0"] <= budget, (placed, after)
