"""The example workflows are for users: every model file they name is a released one (``tools.templates.models``),
with its address for the missing-model dialog, never one of the test fixtures (which the tests swap in)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.templates.models import MODELS

WORKFLOWS = sorted((Path(__file__).resolve().parents[2] / "workflows").glob("*.json"))
MODEL_SUFFIXES = (".safetensors", ".gguf", ".pth", ".ckpt")


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_each_template_names_released_files_only(path):
    workflow = json.loads(path.read_text())
    named = [
        value
        for node in workflow["nodes"]
        for value in node.get("widgets_values") or []
        if isinstance(value, str) and value.endswith(MODEL_SUFFIXES)
    ]
    assert named, path.stem
    fixtures = [name for name in named if name.startswith("device_control_")]
    assert not fixtures, f"{path.stem} names test fixtures: {fixtures}"
    assert all(name in MODELS for name in named), [name for name in named if name not in MODELS]
