"""The real frontend loads our extension, opens an example workflow, runs it, and shows the reports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tools.templates.workflow_api import load_workflow, ui_to_api

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((REPO / "workflows").glob("*.json"))
PLACED = REPO / "workflows" / "02 SD1.5 - UNet on the GPU, text encoder on the CPU.json"


def test_extension_loads_without_errors_of_ours(frontend):
    frontend.open()
    names = frontend.page.evaluate("window.app.extensions.map(e => e.name)")
    assert "DeviceControl.NodeText" in names
    frontend.page.wait_for_timeout(1000)
    assert frontend.our_errors() == []


def test_frontend_converts_each_workflow_as_our_converter_does(graph_page):
    """Every example workflow, loaded in turn into one page as the frontend's Load does, converts to the prompt our
    converter makes from the file (a new graph replaces the one before, so each workflow is converted alone)."""
    frontend = graph_page
    object_info = frontend.server.get("/object_info")
    simplify = lambda prompt: {k: (v["class_type"], v["inputs"]) for k, v in prompt.items()}  # noqa: E731
    differ = []
    for workflow in WORKFLOWS:
        frontend.load_workflow(workflow)
        from_browser = json.loads(
            frontend.page.evaluate("async () => JSON.stringify((await window.app.graphToPrompt()).output)")
        )
        if simplify(from_browser) != simplify(ui_to_api(load_workflow(workflow), object_info)):
            differ.append(workflow.name)
    assert WORKFLOWS and differ == [], f"the frontend converts these otherwise: {differ}"


def test_workflow_runs_from_the_page_and_reports_show_on_the_canvas(frontend, artifacts):
    frontend.open()
    frontend.load_workflow(PLACED)
    page = frontend.page
    page.evaluate(
        """() => {
            window.__deviceControlTest = [];
            for (const type of ["executed", "execution_success", "execution_error"]) {
                window.app.api.addEventListener(type, (e) => window.__deviceControlTest.push([type, e.detail]));
            }
        }"""
    )
    frontend.click_run()
    page.wait_for_function(
        "window.__deviceControlTest.some(([type]) => type === 'execution_success' || type === 'execution_error')",
        timeout=300_000,
    )
    kinds = [kind for kind, _ in page.evaluate("window.__deviceControlTest")]
    assert "execution_error" not in kinds
    texts = page.evaluate(
        """() => window.app.graph.nodes
            .filter((n) => n.type === "DeviceControl_VRAMReport")
            .map((n) => [n.title, n.widgets.find((w) => w.name === "report_text").element.value])"""
    )
    assert len(texts) == 3
    for title, text in texts:
        label = title.split(": ", 1)[1]
        assert text.startswith(f"VRAM Report - {label} (")
        assert "Devices:" in text and "cpu    CPU" in text and "this process (RSS)" in text
    after_decoding = dict(texts)["VRAM Report: after decoding"]
    assert "gpu:0  Simulated GPU 0 (8.00 GiB) [simulated]: 3.20 GiB used" in after_decoding
    assert "MODEL SD15 diffusion model (BaseModel), 3.20 GiB: 3.20 GiB on gpu:0" in after_decoding
    summary = page.evaluate(
        """() => window.app.graph.nodes.find((n) => n.type === "DeviceControl_LoadCheckpoint")
            .widgets.find((w) => w.name === "report_text").element.value"""
    )
    assert summary.startswith("Stable Diffusion 1.5 (SD15, EPS)") and "gpu:0 (Simulated GPU 0" in summary
    visible = page.locator("textarea.device-control-report").evaluate_all("(els) => els.map((e) => e.value.length)")
    assert len(visible) == 4 and min(visible) > 200
    assert frontend.our_errors() == []
    page.mouse.click(900, 900)  # focus the canvas, then fit the whole graph in view
    page.keyboard.press(".")
    page.wait_for_timeout(500)
    shot = artifacts / "vram_report_canvas.png"
    page.screenshot(path=str(shot))
    shutil.copyfile(shot, artifacts / "latest_browser_run.png")
