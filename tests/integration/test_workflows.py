"""Every example workflow runs end to end in a real ComfyUI, queued again unchanged runs nothing (ComfyUI's cache
answers every node, ours included), and its VRAM Reports carry real numbers (those of the model families shipped as
separate files run in ``test_families.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
from PIL import Image, ImageStat

from tests.integration.executions import watch
from tools.templates.families import FAMILIES, FLUX_GGUF_EXAMPLE

REPO = Path(__file__).resolve().parents[2]
#: Several full-size models at once: runs while no other tier's module does (tests/server_pool.py).
HOLDS_MODELS = True
#: The family workflows (and the GGUF one) run in ``test_families.py``, on a simulated GPU against ComfyUI's stock
#: loaders.
ELSEWHERE = {f.title for f in (*FAMILIES, FLUX_GGUF_EXAMPLE)}
WORKFLOWS = sorted(w for w in (REPO / "workflows").glob("*.json") if w.stem not in ELSEWHERE)
TXT2IMG = REPO / "workflows" / "03 Text to image with VRAM Reports.json"


@pytest.fixture(scope="module")
def fresh_server(synthetic_models, comfy_factory, server_pool, tmp_path_factory):
    """A server of its own, so that its memory before the first prompt is a true baseline; the pool's idle
    servers are stopped first (every example loads its models in this one, up to a few GB each)."""
    server_pool.stop_idle()
    server = comfy_factory(tmp_path_factory.mktemp("workflows-base"))
    yield server
    server.stop()


def test_report_numbers_are_real(fresh_server, api):
    """RSS grows by about the size of the models the reports list: the figures are measured, not made up."""
    baseline = psutil.Process(fresh_server.process.pid).memory_info().rss
    prompt = api.load_prompt(fresh_server, TXT2IMG)
    entry = fresh_server.run(prompt)
    reports = {
        node["inputs"]["label"]: node_id
        for node_id, node in prompt.items()
        if node["class_type"] == "DeviceControl_VRAMReport"
    }
    after_loading = api.report_json(entry, reports["after loading"])
    after_decoding = api.report_json(entry, reports["after decoding"])
    assert after_loading["subject"]["component"] == "MODEL"
    assert after_loading["subject"]["model_class"] == "BaseModel"
    assert after_loading["subject"]["name"] == "SD15 diffusion model"
    components = {m["component"]: m for m in after_decoding["models"]}
    assert set(components) == {"MODEL", "CLIP", "VAE"}
    for model in components.values():  # on CPU every byte of every model is resident in RAM
        assert model["resident"] == {"cpu": model["total_bytes"]}
        assert not model["partial"]
    models_total = sum(m["total_bytes"] for m in components.values())
    grown = after_loading["host"]["process_rss"] - baseline
    # The checkpoint's three models are all in RAM after loading (ComfyUI upcasts them to fp32 on CPU).
    # Allocator overhead and Python objects make RSS a little larger; 15 % covers both.
    assert abs(grown - models_total) < 0.15 * models_total, (grown, models_total)
    assert after_loading["mode"]["vram_state"] == "DISABLED"


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=[w.stem for w in WORKFLOWS])
def test_example_workflow_runs_end_to_end(fresh_server, api, workflow):
    fresh_server.free()  # each example from no model loaded, as a user opening it (and the last one's RAM given back)
    prompt = api.load_prompt(fresh_server, workflow)
    entry = fresh_server.run(prompt)
    saved = 0
    for node_id, node in prompt.items():
        if node["class_type"] == "SaveImage":
            for image in entry["outputs"][node_id]["images"]:
                path = fresh_server.base / "output" / image["subfolder"] / image["filename"]
                with Image.open(path) as picture:
                    # Random weights still give an image with structure; a blank one means a broken pipeline.
                    assert max(ImageStat.Stat(picture.convert("RGB")).stddev) > 1.0
                saved += 1
        if node["class_type"] == "DeviceControl_VRAMReport":
            text = api.report_text(entry, node_id)
            label = node["inputs"]["label"]
            assert text.startswith(f"VRAM Report - {label} (")
            for section in ("Devices:", "RAM:", "Memory mode:", "Models loaded by ComfyUI"):
                assert section in text
            data = api.report_json(entry, node_id)
            assert data["label"] == label and data["devices"]
    assert saved >= 1, f"{workflow.name} saved no image"
    moves = [node_id for node_id, node in prompt.items() if node["class_type"] == "DeviceControl_MoveToGPU"]
    assert sorted(api.moves_hold(entry, prompt)) == sorted(moves), "a move with no VRAM Report after it"
    assert json.loads(workflow.read_text())["nodes"], "workflow has no nodes"
    again = watch(fresh_server, prompt)  # queued again unchanged: as with stock nodes, nothing runs
    assert again.prompt_id, (workflow.name, again.error, again.node_errors)
    assert again.executed == [], f"{workflow.name}: queued again unchanged, it ran {again.executed}"
