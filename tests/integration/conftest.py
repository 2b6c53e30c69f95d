"""Integration tier: a real ComfyUI server, driven over its HTTP API.

Helpers reach the tests as fixtures (``api``), because test folders are not packages here.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tools.comfy_server import ComfyServer
from tools.workflow_api import ui_to_api

REPO = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.integration)


def load_prompt(server: ComfyServer, workflow: Path) -> dict[str, Any]:
    """The API-format prompt for a UI-format workflow file, converted against this server's nodes."""
    return ui_to_api(json.loads(workflow.read_text()), server.get("/object_info"))


def report_prompt(**inputs: Any) -> dict[str, Any]:
    """A one-node prompt: a VRAM Report with these inputs."""
    return {"1": {"class_type": "DeviceControl_VRAMReport", "inputs": {"label": "", "devices": "all", **inputs}}}


def report_text(entry: dict[str, Any], node_id: str = "1") -> str:
    """The text a VRAM Report node showed, from a history entry."""
    return entry["outputs"][node_id]["text"][0]


def report_json(entry: dict[str, Any], node_id: str = "1") -> dict[str, Any]:
    """The JSON form of a VRAM Report node's report, from a history entry."""
    return json.loads(entry["outputs"][node_id]["device_control_report"][0])


def image_of(server: ComfyServer, entry: dict[str, Any]) -> np.ndarray:
    """The first image a finished prompt saved, as RGB pixels (int16, so differences do not wrap)."""
    image = next(v for v in entry["outputs"].values() if "images" in v)["images"][0]
    with Image.open(server.base / "output" / image["subfolder"] / image["filename"]) as picture:
        return np.asarray(picture.convert("RGB"), dtype=np.int16)


@pytest.fixture(scope="session")
def api() -> SimpleNamespace:
    """Helpers for building prompts and reading VRAM Report results."""
    return SimpleNamespace(
        load_prompt=load_prompt,
        report_prompt=report_prompt,
        report_text=report_text,
        report_json=report_json,
        image_of=image_of,
        workflows=sorted((REPO / "workflows").glob("*.json")),
        our_nodes={
            "DeviceControl_VRAMReport": "VRAM Report",
            "DeviceControl_LoadCheckpoint": "Load Checkpoint With Device",
        },
    )
