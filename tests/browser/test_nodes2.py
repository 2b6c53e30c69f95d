"""Nodes 2.0 (the frontend's Vue nodes, ``Comfy.VueNodes.Enabled``; the default of new desktop and cloud installs
since frontend 1.41): on the newest frontend served, with it switched on, the memory profile's badges are drawn over
the nodes that ran (the heaviest marked), our nodes show their reports in their own DOM node (a freshly dropped
one's box as tall as its text; a loader's progress text gone once it ended), and the panel works."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.browser.panel_clicks import click_and_confirm
from tests.browser.profile_checks import (
    BADGES_SETTING,
    assert_badges_show_the_profile,
    assert_run_chart_is_readable,
    drawn_badges,
)
from tests.browser.test_panel import GPU_ROW, PANEL, PLACED, UNET_BYTES, open_panel, run_workflow
from tests.passes import ONCE
from tools.runtime.provision import NEWEST_FRONTEND

VUE_NODES_SETTING = "Comfy.VueNodes.Enabled"

# Nodes 2.0 exists on newer frontends only: the newest, and 1.45.21 (ComfyUI 0.28.0's, whose Vue nodes keep a
# node's progress text to the next run); each is the same whatever ComfyUI serves it, so it runs once.
pytestmark = [
    pytest.mark.parametrize("frontend_version", [NEWEST_FRONTEND, "1.45.21"], indirect=True, scope="module"),
    ONCE,
]


def _report_in_vue_node(page: Any, node_id: str) -> str | None:
    """The report text shown inside the Vue node ``node_id`` (its DOM element), as a user would read it."""
    return page.evaluate(
        """(id) => {
            const el = document.querySelector(`[data-node-id="${id}"]`);
            const area = el?.querySelector("textarea.device-control-report");
            return area && area.offsetParent !== null ? area.value : null;
        }""",
        node_id,
    )


def _on_top(page: Any, badge: dict) -> bool:
    """Whether the middle of ``badge`` (graph coordinates) is on screen with the badge on top there: the canvas, or
    the badge's own DOM element (Vue nodes are DOM elements over the canvas: a badge drawn under one is not seen)."""
    return page.evaluate(
        """(b) => {
            const canvas = window.app.canvas;
            const [x, y] = canvas.ds.convertOffsetToCanvas([b.x + b.width / 2, b.y + b.height / 2]);
            const r = canvas.canvas.getBoundingClientRect();
            const layer = document.querySelector(".dc-badges");  // hit-tested only for this probe
            if (layer) layer.style.pointerEvents = "auto";
            const top = document.elementFromPoint(r.x + x, r.y + y);
            if (layer) layer.style.pointerEvents = "none";
            return top === canvas.canvas || (top?.classList.contains("dc-badge") && top.textContent === b.text);
        }""",
        badge,
    )


def _seen_on_top(page: Any, badges: dict[str, dict], seconds: float = 10.0) -> dict[str, bool]:
    """Which of ``badges`` are on top, waited for up to ``seconds`` until all are: the frontend lays its Vue nodes
    out and shows its toasts a few frames after a run, and what covers a badge for one frame is not a failure."""
    deadline = time.monotonic() + seconds
    while True:
        seen = {node: _on_top(page, badge) for node, badge in badges.items()}
        if all(seen.values()) or time.monotonic() > deadline:
            return seen
        page.wait_for_timeout(250)


def _drop_a_vram_report(page: Any) -> str:
    """A VRAM Report dropped fresh into the graph (its default size), fed by the loader's MODEL, right of the
    example; its id."""
    return page.evaluate(
        """() => {
            const node = window.LiteGraph.createNode("DeviceControl_VRAMReport");
            const right = Math.max(...window.app.graph.nodes.map((n) => n.pos[0] + n.size[0]));
            node.pos = [right + 60, 0];
            window.app.graph.add(node);
            window.app.graph.getNodeById(1).connect(0, node, 0);
            return String(node.id);
        }"""
    )


def _report_box(page: Any, node_id: str) -> dict:
    """The report box of the Vue node ``node_id``: its lines of text, the lines it shows, whether it scrolls."""
    return page.evaluate(
        """(id) => {
            const area = document.querySelector(`[data-node-id="${id}"] textarea.device-control-report`);
            const line = parseFloat(getComputedStyle(area).lineHeight) || 14;
            return {lines: area.value.split("\\n").length, shown: area.clientHeight / line,
                    scrolls: area.scrollHeight > area.clientHeight + 1};
        }""",
        node_id,
    )


def _read_when_it_ends(page: Any, node_id: str) -> None:
    """Keep, in the page, the progress text node ``node_id`` sent, and what its Vue node shows outside its report box
    just after it ended (its ``executed`` event, two frames later), while the prompt still runs."""
    page.evaluate(
        """(id) => {
            window.__dcAtEnd = null;
            window.__dcProgress = "";
            window.app.api.addEventListener("progress_text", (e) => {
                if (String(e.detail?.nodeId) === id) window.__dcProgress += e.detail.text;
            });
            window.app.api.addEventListener("executed", (e) => {
                if (String(e.detail?.display_node ?? e.detail?.node) !== id) return;
                requestAnimationFrame(() => requestAnimationFrame(() => {
                    const el = document.querySelector(`[data-node-id="${id}"]`);
                    const boxes = [...el.querySelectorAll("textarea:not(.device-control-report)")].map((a) => a.value);
                    window.__dcAtEnd = [el.innerText, ...boxes].join("\\n");
                }));
            });
        }""",
        node_id,
    )


def _progress_text_in_vue_node(page: Any, node_id: str) -> str:
    """The text the Vue node ``node_id`` shows outside its report box: its text, and the values of its other text
    boxes (where a progress text is left)."""
    return page.evaluate(
        """(id) => {
            const el = document.querySelector(`[data-node-id="${id}"]`);
            const boxes = [...el.querySelectorAll("textarea:not(.device-control-report)")].map((a) => a.value);
            return [el.innerText, ...boxes].join("\\n");
        }""",
        node_id,
    )


def test_profile_badges_node_texts_and_panel_with_nodes_2(frontend, artifacts):
    frontend.server.post(f"/settings/{VUE_NODES_SETTING}", True)
    page = open_panel(frontend)
    assert page.evaluate("(id) => window.app.extensionManager.setting.get(id)", VUE_NODES_SETTING) is True
    assert "Simulated GPU 0" in page.locator(GPU_ROW).inner_text()

    frontend.load_workflow(PLACED)
    fresh = _drop_a_vram_report(page)
    _read_when_it_ends(page, "1")
    run_workflow(frontend, None)
    ours = page.evaluate(
        """() => window.app.graph.nodes.filter((n) => n.type.startsWith("DeviceControl_")).map((n) => String(n.id))"""
    )
    assert sorted(ours) == sorted(["1", "2", "7", "9", fresh])
    for node_id in ours:  # each a Vue node: a DOM element of its own, not drawn on the canvas
        page.wait_for_selector(f'[data-node-id="{node_id}"]', timeout=30_000)
    # The fresh report's box took the height of its text (a few lines more at most scroll), not two lines.
    box = _report_box(page, fresh)
    assert box["lines"] > 10 and box["shown"] >= min(box["lines"], 24) - 0.5 and not box["scrolls"], box
    # The loader's progress text ("Loading ...: the fit plan") ended with it, not with the prompt: its report says
    # what it did.
    assert "the fit plan" in page.evaluate("window.__dcProgress")  # the loader said what it was doing
    at_end = page.evaluate("window.__dcAtEnd")
    assert at_end is not None and "the fit plan" not in at_end, at_end
    assert "the fit plan" not in _progress_text_in_vue_node(page, "1")
    texts = {node_id: _report_in_vue_node(page, node_id) for node_id in ours}
    assert texts["1"] and texts["1"].startswith("Stable Diffusion 1.5 (SD15, EPS)"), texts
    assert all(texts[i] and texts[i].startswith("VRAM Report - ") for i in ("2", "7", "9")), texts
    assert texts[fresh].startswith("VRAM Report (")
    assert "MODEL SD15 diffusion model (BaseModel), 3.20 GiB: 3.20 GiB on gpu:0" in texts["9"]

    page.wait_for_function("window.__dcProfile", timeout=30_000)
    profile = frontend.server.get("/device_control/profile")
    assert_run_chart_is_readable(page, PANEL, profile)
    assert_badges_show_the_profile(page, profile)
    badges = drawn_badges(page, 0.85, (35, 110))
    if profile["heaviest"]:
        assert badges[profile["heaviest"]["node"]]["text"].startswith("▲")
    # Every badge in view is seen, above the Vue nodes (the example's nodes lie closer than a badge's height).
    in_view = _seen_on_top(page, {node: badge for node, badge in badges.items() if node not in ("1", "2", fresh)})
    assert all(in_view.values()), in_view
    page.screenshot(path=str(artifacts / "profile_badges_nodes2.png"))
    page.evaluate("(id) => window.app.extensionManager.setting.set(id, false)", BADGES_SETTING)
    assert drawn_badges(page) == {} and page.locator(".dc-badge").count() == 0  # the setting hides the DOM ones too
    page.evaluate("(id) => window.app.extensionManager.setting.set(id, true)", BADGES_SETTING)
    _offload_the_unet(page)
    assert frontend.our_errors() == []


def _offload_the_unet(page: Any) -> None:
    """The panel's Offload button on the UNet's row, confirmed: the model leaves gpu:0 and the GPU row says so."""
    unet = page.locator(f"{PANEL} .dc-model", has_text="MODEL SD15 diffusion model")
    assert int(unet.get_attribute("data-resident")) >= UNET_BYTES * 0.95
    own_before = int(page.locator(GPU_ROW).get_attribute("data-own"))
    click_and_confirm(page, unet.locator(".dc-offload"))
    page.wait_for_function(
        "([row, most]) => Number(document.querySelector(row).dataset.own) <= most",
        arg=[GPU_ROW, own_before - UNET_BYTES * 0.95],
        timeout=30_000,
    )
    resident = page.locator(f"{PANEL} .dc-model").evaluate_all(
        "(rows) => rows.map((r) => [r.textContent, r.dataset.resident])"
    )
    assert not [name for name, size in resident if name.startswith("MODEL") and int(size) > 0], resident
