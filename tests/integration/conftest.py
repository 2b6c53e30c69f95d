"""Integration tier: a real ComfyUI server, driven over its HTTP API.

Helpers reach the tests as fixtures (``api``), because test folders are not packages here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from PIL import Image

from core.units import format_bytes
from tests.passes import LIGHT_MODULES, collects
from tests.server_pool import ServerPool
from tests.server_pool import machine_ram as share_machine_ram
from tools.runtime.server import ComfyServer
from tools.templates.workflow_api import load_workflow, ui_to_api

REPO = Path(__file__).resolve().parents[2]


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    """The light or heavy modules only, where a whole run asks for them (:data:`tests.passes.MODULES_ENV`)."""
    return None if collects(collection_path) else True


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.integration)


def load_prompt(server: ComfyServer, workflow: Path) -> dict[str, Any]:
    """The API-format prompt for a UI-format workflow file on the test models, converted against this server's
    nodes."""
    return ui_to_api(load_workflow(workflow), server.get("/object_info"))


def report_prompt(**inputs: Any) -> dict[str, Any]:
    """A one-node prompt: a VRAM Report with these inputs."""
    return {"1": {"class_type": "DeviceControl_VRAMReport", "inputs": {"label": "", "devices": "all", **inputs}}}


def report_text(entry: dict[str, Any], node_id: str = "1") -> str:
    """The text a VRAM Report node showed, from a history entry."""
    return entry["outputs"][node_id]["text"][0]


def report_json(entry: dict[str, Any], node_id: str = "1") -> dict[str, Any]:
    """The JSON form of a VRAM Report node's report, from a history entry."""
    return json.loads(entry["outputs"][node_id]["device_control_report"][0])


def image_of(server: ComfyServer, entry: dict[str, Any], node: str | None = None) -> np.ndarray:
    """The first image a finished prompt saved (that ``node`` saved, when given), as RGB pixels (int16, so
    differences do not wrap)."""
    saved = entry["outputs"][node] if node else next(v for v in entry["outputs"].values() if "images" in v)
    image = saved["images"][0]
    with Image.open(server.base / "output" / image["subfolder"] / image["filename"]) as picture:
        return np.asarray(picture.convert("RGB"), dtype=np.int16)


_RESIDENT = re.compile(r"([0-9.]+ [KMGT]?i?B) resident on (\S+?)[,;\n ]")


def moves_hold(entry: dict[str, Any], prompt: dict[str, Any]) -> list[str]:
    """Check every Move To GPU of ``prompt`` against the bytes measured after it; return the nodes checked.

    A move is checked through the VRAM Report that takes its output: the model must be resident on the device
    the move's summary names, with exactly the bytes it states, under Device Control's placement. (A summary
    alone is the node's claim; the report reads where the weights are.) A move answered from ComfyUI's cache did
    not run in this prompt and is not checked.
    """
    checked = []
    for node_id, node in prompt.items():
        if node["class_type"] != "DeviceControl_MoveToGPU" or node_id not in entry["outputs"]:
            continue
        summary = entry["outputs"][node_id]["text"][0]
        claimed = _RESIDENT.search(summary)
        assert claimed, f"Move To GPU {node_id} does not say where the model is: {summary}"
        size, device = claimed.groups()
        for report_id, report in prompt.items():
            if report["class_type"] != "DeviceControl_VRAMReport" or report["inputs"].get("value") != [node_id, 0]:
                continue
            subject = report_json(entry, report_id)["subject"]
            assert format_bytes(subject["resident"].get(device, 0)) == size, (summary, subject["resident"])
            assert subject["compute_device"] == device and subject["managed_by"] == "Device Control", subject
            checked.append(node_id)
    return checked


#: Our nodes that only pass a value on (output slot -> the input it passes): gone in a stock equivalent.
PASSTHROUGH = {
    "DeviceControl_MoveToGPU": {0: "model", 1: "trigger"},
    "DeviceControl_SplitModel": {0: "model", 1: "trigger"},
    "DeviceControl_OffloadToCPU": {0: "trigger"},
    "DeviceControl_VRAMReport": {0: "value"},
}


#: ComfyUI's CLIP loader for each number of text-encoder files (Triple and Quadruple take no type).
STOCK_CLIP_LOADERS = {1: "CLIPLoader", 2: "DualCLIPLoader", 3: "TripleCLIPLoader", 4: "QuadrupleCLIPLoader"}


def stock_clip_loader(inputs: dict[str, Any]) -> dict[str, Any]:
    """The stock CLIP loader node (class and inputs) that loads what Load Text Encoders With Device is given."""
    files = [inputs[f"clip_name{i}"] for i in range(1, 5) if inputs.get(f"clip_name{i}", "none") != "none"]
    stock: dict[str, Any] = {"clip_name": files[0]} if len(files) == 1 else {}
    if len(files) > 1:
        stock = {f"clip_name{i}": name for i, name in enumerate(files, 1)}
    if len(files) <= 2:
        stock["type"] = inputs["type"]
    return {"class_type": STOCK_CLIP_LOADERS[len(files)], "inputs": stock}


#: Our loaders of the other model types, and ComfyUI's loader of each with the input naming the file.
STOCK_TYPE_LOADERS = {
    "DeviceControl_LoadControlNet": ("ControlNetLoader", "control_net_name"),
    "DeviceControl_LoadCLIPVision": ("CLIPVisionLoader", "clip_name"),
    "DeviceControl_LoadModelPatch": ("ModelPatchLoader", "name"),
}


def stock_equivalent(prompt: dict[str, Any]) -> dict[str, Any]:
    """The same graph with ComfyUI's own nodes only: our loaders become CheckpointLoaderSimple, UNETLoader, the CLIP
    loaders, VAELoader and ComfyUI's ControlNet (a difference one's where a model is connected), CLIP vision and model
    patch loaders, Upscale Image With Device its Upscale Image (using Model), and our pass-through nodes disappear
    (their outputs are wired to what they received)."""
    stock = json.loads(json.dumps(prompt))

    def resolve(link: list[Any]) -> list[Any]:
        node = stock[link[0]]
        through = PASSTHROUGH.get(node["class_type"], {})
        if link[1] in through:
            return resolve(node["inputs"][through[link[1]]])
        return link

    for node in stock.values():
        if node["class_type"] == "DeviceControl_LoadCheckpoint":
            node["class_type"] = "CheckpointLoaderSimple"
            node["inputs"] = {"ckpt_name": node["inputs"]["ckpt_name"]}
        elif node["class_type"] == "DeviceControl_LoadDiffusionModel":
            dtype = node["inputs"]["dtype"]
            node["class_type"] = "UNETLoader"
            weight_dtype = dtype if dtype.startswith("fp8") else "default"
            node["inputs"] = {"unet_name": node["inputs"]["unet_name"], "weight_dtype": weight_dtype}
        elif node["class_type"] == "DeviceControl_LoadTextEncoders":
            node.update(stock_clip_loader(node["inputs"]))
        elif node["class_type"] == "DeviceControl_LoadVAE":
            node["class_type"] = "VAELoader"
            node["inputs"] = {"vae_name": node["inputs"]["vae_name"]}
        elif node["class_type"] == "DeviceControl_UpscaleImage":
            node["class_type"] = "ImageUpscaleWithModel"
            node["inputs"] = {"upscale_model": node["inputs"]["upscale_model"], "image": node["inputs"]["image"]}
        elif node["class_type"] in STOCK_TYPE_LOADERS:
            stock_type, name = STOCK_TYPE_LOADERS[node["class_type"]]
            inputs = {
                name: node["inputs"][name],
                **({"model": node["inputs"]["model"]} if "model" in node["inputs"] else {}),
            }
            node["class_type"] = "DiffControlNetLoader" if "model" in inputs else stock_type
            node["inputs"] = inputs
    for node in stock.values():
        for name, value in list(node["inputs"].items()):
            if isinstance(value, list) and len(value) == 2 and value[0] in stock:
                node["inputs"][name] = resolve(value)
    return {key: node for key, node in stock.items() if node["class_type"] not in PASSTHROUGH}


@pytest.fixture(autouse=True)
def without_autograd() -> Iterator[None]:
    """Each test computes without autograd, as ComfyUI runs every node (in inference mode). A model that ComfyUI's
    own API runs in this process otherwise keeps, through its autograd graph, its weights and activations after the
    test: 3.5 GB for each CLIP vision encode of ``test_model_type_outputs.py``, 8.9 GB held by the heavy modules'
    pytest for the rest of its run, which OOM-killed a server of the job beside it."""
    import torch

    with torch.no_grad():
        yield


@pytest.fixture(scope="module", autouse=True)
def machine_ram(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each module shares the machine's RAM with the other tier's (:func:`tests.server_pool.machine_ram`); one that
    sets ``HOLDS_MODELS = True`` (several full-size models at once) runs while no other tier's module does. A light
    module (:data:`tests.passes.LIGHT_MODULES`) takes no turn: a whole run counts its RAM beside any other module's."""
    light = Path(request.module.__file__).stem in LIGHT_MODULES
    with nullcontext() if light else share_machine_ram(alone=getattr(request.module, "HOLDS_MODELS", False)):
        yield


@pytest.fixture(scope="module")
def servers(server_pool: ServerPool) -> Iterator[Callable[..., ComfyServer]]:
    """A ComfyUI server for this module: ``servers("name", SIMULATE_GPU="8GiB")`` sets
    ``DEVICE_CONTROL_SIMULATE_GPU``. ``extra_args`` are ComfyUI flags, ``env`` more environment variables as they are
    named. Servers come from the session's pool (:mod:`tests.server_pool`): one another module used with the same
    settings, with nothing loaded, cached or set, or a new one (``name`` names its folder). A module uses one at a
    time (taking one gives the one before back, so a module's tests must use its servers in order): each holds whole
    models in RAM while it works."""
    taken: list[ComfyServer] = []

    def take(
        name: str, extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None, **settings: str
    ) -> ComfyServer:
        while taken:
            server_pool.give_back(taken.pop())
        env = {**(env or {}), **{f"DEVICE_CONTROL_{key}": value for key, value in settings.items()}}
        server = server_pool.take(name, env, extra_args)
        taken.append(server)
        return server

    yield take
    while taken:
        server_pool.give_back(taken.pop())


@pytest.fixture(scope="session")
def api() -> SimpleNamespace:
    """Helpers for building prompts and reading VRAM Report results."""
    return SimpleNamespace(
        load_prompt=load_prompt,
        report_prompt=report_prompt,
        report_text=report_text,
        report_json=report_json,
        image_of=image_of,
        stock_equivalent=stock_equivalent,
        moves_hold=moves_hold,
        workflows=sorted((REPO / "workflows").glob("*.json")),
        our_nodes={
            "DeviceControl_VRAMReport": "VRAM Report",
            "DeviceControl_LoadCheckpoint": "Load Checkpoint With Device",
            "DeviceControl_LoadDiffusionModel": "Load Diffusion Model With Device",
            "DeviceControl_LoadTextEncoders": "Load Text Encoders With Device",
            "DeviceControl_LoadVAE": "Load VAE With Device",
            "DeviceControl_LoadControlNet": "Load ControlNet With Device",
            "DeviceControl_LoadCLIPVision": "Load CLIP Vision With Device",
            "DeviceControl_LoadModelPatch": "Load Model Patch With Device",
            "DeviceControl_UpscaleImage": "Upscale Image With Device",
            "DeviceControl_MoveToGPU": "Move To GPU",
            "DeviceControl_OffloadToCPU": "Offload To CPU",
            "DeviceControl_SplitModel": "Split Model Across Devices",
        },
    )
