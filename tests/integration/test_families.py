"""Every model family that ships as separate files, end to end in a real ComfyUI on a simulated 12 GiB GPU:
SDXL, SD3.5, Flux, Chroma and Wan 2.1 (five frames), on every ComfyUI the suite runs on (all three build them;
SDXL's tests in the primary version's pass only, below).

For each family:

* its example workflow (our three split-file loaders, Move To GPU under a budget, the VAE decoding on ``gpu:0``)
  gives the image of the same graph with ComfyUI's stock loaders (``UNETLoader``, ``CLIPLoader`` /
  ``DualCLIPLoader``, ``VAELoader``), bit for bit, fp32 compute on the CPU; every move is checked against the
  bytes the VRAM Report reads from the weights;
* Move To GPU with a budget below the diffusion model (40 %; 75 % for the small SD3.5), after a LoRA from
  ComfyUI's stock ``LoraLoaderModelOnly``, keeps that much resident on ``gpu:0`` and streams the rest, and the
  image is the stock graph's (no node of ours, everything resident in RAM); Offload To CPU then gives the simulated
  GPU's books back to what they were before the move, and the VRAM Report names the family and where its bytes are.

And Flux Redux's example (a CLIP vision model, SigLIP, loaded onto ``gpu:0`` by our loader, encoding the example
image there, offloaded before Flux moves in) gives the image of the stock graph, which Redux's tokens change.

The diffusion models are ComfyUI's own classes at reduced depth (``tools/fixtures/families.py``); SDXL's UNet is
SDXL 1.0 base's layout at Segmind Vega's depth (ComfyUI builds it as one of its SDXL classes). The text conditioning
comes from CLIP-L (and CLIP-G for SDXL) as ComfyUI's ``sd3`` type (for SDXL, ``sdxl``): the files these families
really use for text (T5-XXL, UMT5-XXL) are too big to generate, and the ``sd3`` type's output has the widths the
models take (4096 per token, 2048 pooled). The LoRA test stores the diffusion model as ComfyUI does on a CPU, in
fp32, on both sides (SDXL's takes 3.2 GiB then).
"""

from __future__ import annotations

import asyncio
import json
import re
import struct
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from PIL import Image

from core.detection.headers import read_header
from tests.host_math import same_result
from tests.integration.executions import watch
from tests.passes import EVERY_VERSION, ONCE
from tools.bench.stress import run_coroutine
from tools.fixtures.families import DIFFUSION_FIXTURES
from tools.fixtures.model_types import FILES
from tools.templates.families import FAMILIES, FLUX_GGUF_EXAMPLE, Family

REPO = Path(__file__).resolve().parents[2]
#: Several full-size models at once: runs while no other tier's module does (tests/server_pool.py).
HOLDS_MODELS = True
MiB = 1024**2
#: The family's diffusion-model fixture (its ``make_all()`` key) and the LoRA made for it, by workflow.
FIXTURE_OF = {
    "09_sdxl_split_files_unet_on_gpu": "sdxl_unet",
    "13_sd35_split_files_fp8_budget": "sd35",
    "10_flux_split_files_fp8_budget": "flux",
    "14_chroma_split_files_fp8_budget": "chroma",
    "15_wan21_split_files_fp8_budget": "wan21",
}
LORA_OF = {"sdxl_unet": "lora_sdxl", "sd35": "lora_sd35", "flux": "lora_flux", "chroma": "lora_chroma"}
LORA_OF["wan21"] = "lora_wan21"
#: Share of the diffusion model the LoRA test's budget allows: below the whole model, above what cannot stream (the
#: small SD3.5 model's position table, which is not a layer, is nearly half of it).
BUDGET_SHARE = {"sd35": 0.75}
#: The least share of a budget the weights resident under it must take: 90 % of what the streaming reserve (at most
#: 1/12 of the budget, ``core.placement.plan``) leaves.
USED = 0.90 * (1 - 1 / 12)
#: Below this budget the streaming reserve's smallest unit (1 MiB, three copies) is more than 1/12 of it.
MIN_FOR_SHARE = 36 * MiB


@pytest.fixture(scope="module")
def server(servers, server_pool):
    """The module's server; the pool's idle ones are stopped first: SDXL's UNet alone takes 3.2 GiB in fp32 here."""
    server_pool.stop_idle()
    return servers("families", SIMULATE_GPU="12GiB")


def images_of(server, entry: dict[str, Any]) -> list[np.ndarray]:
    """Every image a finished prompt saved (a video's frames, in order), as RGB pixels."""
    saved = next(v for v in entry["outputs"].values() if "images" in v)["images"]
    pixels = []
    for image in saved:
        with Image.open(server.base / "output" / image["subfolder"] / image["filename"]) as picture:
            pixels.append(np.asarray(picture.convert("RGB"), dtype=np.int16))
    return pixels


def _run_alone(server, prompt: dict[str, Any]) -> dict[str, Any]:
    """Run ``prompt`` on a server with nothing loaded or cached."""
    server.free()
    return server.run(prompt)


def _same_images(server, ours: dict[str, Any], stock: dict[str, Any], what: str) -> None:
    got, expected = images_of(server, ours), images_of(server, stock)
    assert len(got) == len(expected) > 0, what
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert same_result(a, b), f"{what}: image {index} differs from ComfyUI's stock graph"
        assert a.std() > 1.0, f"{what}: image {index} is blank (a broken pipeline on both sides)"


#: SDXL's UNet is ComfyUI's SD1.5 class (openaimodel) at a larger size, which the SD1.5 family and the LoRA tests
#: stream in every version's pass; its two tests, the longest of the module (ComfyUI's stock loader holds the UNet
#: in fp32 on a CPU), run once, in the primary version's (0.3.75). The other families run in every pass.
ONCE_FOR_SDXL = [
    pytest.param(
        f,
        id=f.stem,
        marks=[ONCE] if FIXTURE_OF[f.stem] == "sdxl_unet" else [],  # by its model: the file names are numbered
    )
    for f in FAMILIES
]


@EVERY_VERSION  # each ComfyUI builds each family its own way
@pytest.mark.parametrize("family", ONCE_FOR_SDXL)
def test_the_example_workflow_gives_the_stock_loaders_image(server, api, family: Family):
    prompt = api.load_prompt(server, REPO / "workflows" / f"{family.title}.json")
    ours = _run_alone(server, prompt)
    assert api.moves_hold(ours, prompt), "the move was not checked against the books"
    again = watch(server, prompt)  # queued again unchanged: as with stock nodes, nothing runs
    assert again.prompt_id and again.executed == [], f"{family.stem}: queued again, it ran {again.executed}"
    stock = _run_alone(server, api.stock_equivalent(prompt))
    _same_images(server, ours, stock, family.stem)
    summary = ours["outputs"]["4"]["text"][0]  # Load Text Encoders With Device's summary
    assert f"{family.clip_type} text encoders: CLIP-L" in summary and "text encoder CLIP-L: cpu" in summary


#: The CLIP vision example: Flux Redux, its image encoder on gpu:0 and offloaded before Flux moves in.
REDUX = REPO / "workflows" / "19 Flux Redux - the image encoded on the GPU, then offloaded.json"
#: USO's style projector (a model patch for Flux).
MODEL_PATCH = FILES["model_patch"][1]


@ONCE  # test_workflows runs it on every ComfyUI, test_model_type_outputs compares a placed encoder's output on each
def test_the_redux_example_gives_the_stock_image_with_its_image_encoder_on_the_gpu_then_offloaded(server, api):
    prompt = api.load_prompt(server, REDUX)
    ours = _run_alone(server, prompt)
    loaded, offloaded = ours["outputs"]["1"]["text"][0], ours["outputs"]["4"]["text"][0]
    assert loaded.startswith("SigLIP 384 from "), loaded  # what the loader read the file as
    placed = re.search(r"CLIP vision model \((\w+)\) ([\d.]+ [KMG]iB): \2 resident on gpu:0\n", loaded)
    assert placed, loaded  # whole on gpu:0, where it encodes; then every byte of it leaves
    assert f"CLIP vision model ({placed[1]}): {placed[2]} freed on gpu:0" in offloaded, offloaded
    assert api.moves_hold(ours, prompt), "the move was not checked against the books"
    stock = _run_alone(server, api.stock_equivalent(prompt))
    _same_images(server, ours, stock, "19_flux_redux")
    # Redux's tokens reach the sampler: without them, another image.
    plain = {**prompt, "15": {**prompt["15"], "inputs": {**prompt["15"]["inputs"], "positive": ["11", 0]}}}
    assert not np.array_equal(images_of(server, _run_alone(server, plain))[0], images_of(server, ours)[0])


@EVERY_VERSION  # each ComfyUI applies a model patch its own way
def test_usos_style_patch_loaded_onto_fluxs_gpu_gives_the_stock_image_which_it_changes(server, api):
    """ComfyUI's ModelPatchLoader and USO Style Reference as the oracle: USO's style projector loaded onto gpu:0 by
    Load Model Patch With Device, applied to Flux moved there, gives the image of the same graph loaded by ComfyUI's
    loader; without the patch, another image (it reached Flux's steps)."""
    prompt = api.load_prompt(server, REDUX)  # its SigLIP encoding feeds USO instead of Redux
    for node in ("12", "13"):
        prompt.pop(node)
    patch = {"name": MODEL_PATCH, "device": "gpu:0", "vram_budget": "all", "dtype": "auto"}
    prompt["20"] = {"class_type": "DeviceControl_LoadModelPatch", "inputs": patch}
    uso = {"model": ["7", 0], "model_patch": ["20", 0], "clip_vision_output": ["3", 0]}
    prompt["21"] = {"class_type": "USOStyleReference", "inputs": uso}
    prompt["15"]["inputs"].update(model=["21", 0], positive=["11", 0])
    ours = _run_alone(server, prompt)
    loaded = ours["outputs"]["20"]["text"][0]
    placed = re.search(r"model patch \((\w+)\) ([\d.]+ [KMG]iB): \2 resident on gpu:0\n", loaded)
    assert placed, loaded  # whole on gpu:0, beside Flux
    _same_images(server, ours, _run_alone(server, api.stock_equivalent(prompt)), "USO style patch")
    plain = {**prompt, "15": {**prompt["15"], "inputs": {**prompt["15"]["inputs"], "model": ["7", 0]}}}
    assert not np.array_equal(images_of(server, _run_alone(server, plain))[0], images_of(server, ours)[0])


def lora_prompt(family: Family, lora: str, budget: str) -> dict[str, Any]:
    """Our loaders, a stock LoRA, Move To GPU under ``budget``, sampling, Offload To CPU, decoding; VRAM Reports
    before the move, after it and after the offload."""
    files = [*family.text_encoders, *["none"] * (4 - len(family.text_encoders))]
    text = dict(zip(("clip_name1", "clip_name2", "clip_name3", "clip_name4"), files, strict=True))
    latent_type, latent_widgets = family.latent
    latent_names = ("width", "height", "length", "batch_size") if len(latent_widgets) == 4 else ("width", "height")
    latent = dict(zip(latent_names, latent_widgets, strict=False)) | {"batch_size": latent_widgets[-1]}

    def report(value: list[Any], label: str) -> dict[str, Any]:
        return {"class_type": "DeviceControl_VRAMReport", "inputs": {"value": value, "label": label, "devices": "all"}}

    sampler, scheduler = family.sampler
    return {
        "1": {
            "class_type": "DeviceControl_LoadDiffusionModel",
            "inputs": {"unet_name": family.unet, "device": "cpu", "dtype": "auto"},
        },
        "2": {
            "class_type": "LoraLoaderModelOnly",
            "inputs": {"model": ["1", 0], "lora_name": lora, "strength_model": 1},
        },
        "3": report(["2", 0], "before the move"),
        "4": {
            "class_type": "DeviceControl_MoveToGPU",
            "inputs": {"model": ["3", 0], "device": "gpu:0", "vram_budget": budget, "keep_resident": False},
        },
        "5": report(["4", 0], "after the move"),
        "6": {
            "class_type": "DeviceControl_LoadTextEncoders",
            "inputs": {**text, "type": family.clip_type, "device": "cpu", "dtype": "auto"},
        },
        "7": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["6", 0], "text": "a lighthouse"}},
        "8": {"class_type": latent_type, "inputs": latent},
        "9": {
            "class_type": "KSampler",
            "inputs": {
                "model": ["5", 0],
                "positive": ["7", 0],
                "negative": ["7", 0],
                "latent_image": ["8", 0],
                "seed": 3,
                "steps": 1,
                "cfg": 1.0,
                "sampler_name": sampler,
                "scheduler": scheduler,
                "denoise": 1.0,
            },
        },
        "10": {
            "class_type": "DeviceControl_OffloadToCPU",
            "inputs": {
                "mode": "full",
                "free_amount": "1GB",
                "empty_cache": True,
                "model": ["4", 0],
                "trigger": ["9", 0],
            },
        },
        "11": report(["10", 0], "after the offload"),
        "12": {
            "class_type": "DeviceControl_LoadVAE",
            "inputs": {"vae_name": family.vae, "device": "cpu", "dtype": "auto"},
        },
        "13": {"class_type": "VAEDecode", "inputs": {"samples": ["11", 0], "vae": ["12", 0]}},
        "14": {"class_type": "SaveImage", "inputs": {"images": ["13", 0], "filename_prefix": f"lora_{family.stem}"}},
    }


def _gpu(api, entry: dict[str, Any], node: str) -> dict[str, Any]:
    return next(d for d in api.report_json(entry, node)["devices"] if d["id"] == "gpu:0")


@pytest.mark.parametrize("family", ONCE_FOR_SDXL)
def test_a_budget_below_the_model_with_a_stock_lora_streams_the_rest_and_offload_gives_it_back(
    server, api, synthetic_models, family: Family
):
    key = FIXTURE_OF[family.stem]
    size = _fp32_bytes(synthetic_models[key])
    budget = int(size * BUDGET_SHARE.get(key, 0.4))
    prompt = lora_prompt(family, synthetic_models[LORA_OF[key]].name, f"{budget // MiB}MB")
    ours = _run_alone(server, prompt)
    stock = _run_alone(server, api.stock_equivalent(prompt))
    _same_images(server, ours, stock, f"{family.stem} with a LoRA under a {budget // MiB} MiB budget")

    moved = api.report_json(ours, "5")["subject"]
    assert DIFFUSION_FIXTURES[key].comfy_class in moved["name"], moved["name"]  # the report names the family
    resident = moved["resident"].get("gpu:0", 0)
    assert moved["partial"] and 0 < resident <= budget < moved["total_bytes"], (resident, budget)
    if budget >= MIN_FOR_SHARE:  # the budget is used (the tiny Wan's 5 MiB is below the smallest streaming room)
        assert resident >= USED * budget, (resident, budget)
    assert moved["resident"].get("cpu", 0) == moved["total_bytes"] - resident  # the rest streams from RAM
    assert moved["managed_by"] == "Device Control" and moved["compute_device"] == "gpu:0"
    before, after_move, after_offload = (_gpu(api, ours, node)["torch_allocated"] for node in ("3", "5", "11"))
    assert after_move - before >= resident  # the device's own books hold at least the resident weights
    assert after_offload == before  # and give every byte back after Offload To CPU
    assert "freed (gpu:0" in ours["outputs"]["10"]["text"][0]


def _fp32_bytes(path: Path) -> int:
    """What a diffusion-model file's weights take in fp32, as ComfyUI stores them on a CPU (from its header)."""
    with path.open("rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
    return 4 * sum(int(np.prod(entry["shape"])) for name, entry in header.items() if name != "__metadata__")


#: How far the Q8_0 GGUF example's image may be from the fp16 model's (levels of 255): about twice what was
#: measured, for Q8_0's rounding of every weight (one step of a random model, so differences do not average out).
GGUF_MAX_DIFFERENCE, GGUF_MEAN_DIFFERENCE = 12, 2.0
#: ComfyUI's binary websocket event for a node's progress text (``protocol.BinaryEventTypes.TEXT``).
TEXT_EVENT = 3


async def _node_texts_and_runs(server, prompt: dict[str, Any]) -> list[tuple[str, str, str]]:
    """What the websocket carries for ``prompt``, in order: ``("text", node, text)`` for a node's progress text and
    ``("executed", node, "")`` when a node finished, until the prompt ends."""
    client, seen = uuid.uuid4().hex, []
    async with aiohttp.ClientSession() as session, session.ws_connect(f"{server.url}/ws?clientId={client}") as ws:
        prompt_id = await asyncio.to_thread(server.queue, prompt, client)
        deadline = time.monotonic() + 300
        while (left := deadline - time.monotonic()) > 0:
            message = await ws.receive(timeout=left)
            if message.type == aiohttp.WSMsgType.BINARY and struct.unpack(">I", message.data[:4])[0] == TEXT_EVENT:
                length = struct.unpack(">I", message.data[4:8])[0]
                seen.append(("text", message.data[8 : 8 + length].decode(), message.data[8 + length :].decode()))
            elif message.type == aiohttp.WSMsgType.TEXT:
                data = json.loads(message.data)
                if data["type"] == "executed":
                    seen.append(("executed", data["data"]["node"], ""))
                elif data["type"] == "executing" and (data["data"].get("node"), data["data"].get("prompt_id")) == (
                    None,
                    prompt_id,
                ):
                    return seen
    return seen


def test_each_loader_shows_its_fit_plan_on_the_node_before_reading_a_weight(server, api):
    family = next(f for f in FAMILIES if "_flux_" in f"_{f.stem}")
    prompt = lora_prompt(family, "unused", "all")
    prompt = {key: prompt[key] for key in ("1", "6", "7", "12")}  # the three loaders, and a node that uses the CLIP
    prompt |= {
        node: api.report_prompt(value=[source, 0])["1"] for node, source in (("15", "1"), ("16", "12"), ("17", "7"))
    }
    server.free()
    seen = run_coroutine(_node_texts_and_runs(server, prompt))
    for node, what in (("1", "diffusion model"), ("6", "text encoder"), ("12", "vae")):
        texts = [i for i, (kind, who, text) in enumerate(seen) if kind == "text" and who == node]
        done = next(i for i, (kind, who, _) in enumerate(seen) if kind == "executed" and who == node)
        assert texts and texts[0] < done, f"node {node} showed no fit plan before it finished: {seen}"
        plan = seen[texts[0]][2]
        assert "the fit plan, before any weight is read" in plan and what in plan and "fit on cpu" in plan, plan


def test_the_gguf_example_keeps_its_blocks_quantised_and_gives_the_fp16_models_image(server, api, synthetic_models):
    """The Flux GGUF example (Q8_0) against the stock graph on the fp16 model it was quantised from: the image
    differs only by Q8_0's rounding of the weights; the GPU holds the file's quantised bytes, not floats."""
    prompt = api.load_prompt(server, REPO / "workflows" / f"{FLUX_GGUF_EXAMPLE.title}.json")
    ours = _run_alone(server, prompt)
    assert api.moves_hold(ours, prompt), "the move was not checked against the books"
    moved = api.report_json(ours, "3")["subject"]
    header = read_header(synthetic_models["flux_gguf"], gguf=True)
    blocks = sum(t.nbytes for t in header.tensors.values())
    assert moved["resident"] == {"gpu:0": moved["total_bytes"]}  # 6 GB holds the whole synthetic model
    assert blocks <= moved["total_bytes"] < 1.01 * blocks < 0.6 * _fp32_bytes(synthetic_models["flux"]) / 2
    stock = api.stock_equivalent(prompt)
    stock["1"]["inputs"]["unet_name"] = synthetic_models["flux"].name
    expected = _run_alone(server, stock)
    got, reference = images_of(server, ours)[0], images_of(server, expected)[0]
    difference = np.abs(got - reference)  # 6/255 at most and 0.8/255 on average where this was written
    assert difference.max() <= GGUF_MAX_DIFFERENCE and difference.mean() <= GGUF_MEAN_DIFFERENCE
    assert got.std() > 1.0 and reference.std() > 1.0
