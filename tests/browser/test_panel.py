"""The live panel in the real frontend: a sidebar tab fed by the server's push, with actions that move models."""

from __future__ import annotations

import json
import re
import urllib.error
from pathlib import Path
from typing import Any

import pytest

from tests.browser.conftest import OUR_EXTENSION_PATH, PINNED, FrontendPage
from tests.browser.panel_clicks import click_and_confirm
from tests.browser.profile_checks import (
    LISTEN_FOR_OWN_PROFILE,
    assert_badges_show_the_profile,
    assert_labels_readable,
    assert_run_chart_is_readable,
    drawn_badges,
    overlap,
    seconds,
)
from tests.passes import ONCE
from tools.runtime.provision import DEFAULT_VERSION, NEWEST_FRONTEND, RELEASES

REPO = Path(__file__).resolve().parents[2]
SEED = REPO / "workflows" / "01 Start here - SD1.5 moved to the GPU, then offloaded.json"
PLACED = REPO / "workflows" / "02 SD1.5 - UNet on the GPU, text encoder on the CPU.json"
GIB = 1024**3
UNET_BYTES = int(3.2 * GIB)  # the synthetic SD1.5 UNet, fp32

PANEL = ".device-control-panel"
GPU_ROW = f'{PANEL} .dc-device[data-device="gpu:0"]'
# The tab's button: 1.32.9 gives it a class named after the tab, newer frontends only its tooltip as label.
TAB_BUTTON = '.device-control-tab-button, .side-bar-button[aria-label^="Device Control"]'
NO_RUN_YET = "No run recorded yet: queue a prompt and its memory profile appears here."
UNITS_DECIMAL = "Sizes in GB (10^9 bytes); budgets count 8GB as 8 GiB (8.59 GB)."
BUSY_REASON = "Not while a prompt runs: models are not moved under it. Wait for it to finish, or cancel it."

# Every test runs on the frontend the ComfyUI under test pins (each pass), and on the newest comfyui-frontend-package,
# which is the same in every pass, in the primary ComfyUI's pass (once).
pytestmark = pytest.mark.parametrize(
    "frontend_version", [PINNED, pytest.param(NEWEST_FRONTEND, marks=ONCE)], indirect=True, scope="module"
)


def open_panel(frontend: FrontendPage) -> Any:
    """Open the frontend and the Device Control tab; wait for the first snapshot to be drawn."""
    frontend.open()
    page = frontend.page
    page.locator(TAB_BUTTON).first.click()
    page.wait_for_selector(f"{GPU_ROW}[data-total]", timeout=30_000)
    return page


def record_panel(page: Any) -> None:
    """Keep, in the page, what the panel shows every 100 ms and after each push it drew (the tab's DOM, read as a
    user would see it). The panel's own listener came first, so a push is read here once it is drawn: a state
    pushed and replaced between two 100 ms reads is still seen."""
    page.evaluate(
        """() => {
            window.__dcSeen = [];
            window.__dcDone = false;
            window.__dcError = null;
            for (const type of ["execution_success", "execution_error"]) {
                window.app.api.addEventListener(type, (e) => { window.__dcDone = type; window.__dcError = e.detail; });
            }
            const read = () => {
                const row = document.querySelector('.device-control-panel .dc-device[data-device="gpu:0"]');
                const models = [...document.querySelectorAll('.device-control-panel .dc-model')].map((m) => [
                    m.querySelector('.dc-model-name').textContent, Number(m.dataset.resident)]);
                const offload = document.querySelector('.device-control-panel .dc-offload-all');
                const status = document.querySelector('.device-control-panel .dc-status')?.textContent ?? "";
                window.__dcSeen.push({own: Number(row?.dataset.own ?? -1), models, status,
                                      busy: offload?.disabled ?? null, reason: offload?.title ?? ""});
            };
            window.app.api.addEventListener("device_control.vram", read);
            window.__dcTimer = setInterval(read, 100);
        }"""
    )


def run_workflow(frontend: FrontendPage, workflow: Path | None) -> list[dict[str, Any]]:
    """Load ``workflow`` (``None``: the graph shown), press Run, wait for the end; return what the panel showed
    meanwhile."""
    page = frontend.page
    if workflow is not None:
        frontend.load_workflow(workflow)
    record_panel(page)
    page.evaluate(LISTEN_FOR_OWN_PROFILE)
    frontend.click_run()
    page.wait_for_function("window.__dcDone", timeout=300_000)
    page.wait_for_timeout(1500)  # one more push after the end
    assert page.evaluate("window.__dcDone") == "execution_success", page.evaluate("window.__dcError")
    return page.evaluate("clearInterval(window.__dcTimer), window.__dcSeen")


def assert_tab_label_fits(page: Any) -> None:
    """The label the sidebar shows under the tab's icon (where the frontend shows one) is ours, short, and drawn
    whole: no text cut at the sidebar's width."""
    label = page.evaluate(
        """(selector) => {
            const el = document.querySelector(selector)?.querySelector('.side-bar-button-label');
            if (!el || !el.offsetParent) return null;
            const r = el.getBoundingClientRect(), bar = el.closest('.side-bar-button').getBoundingClientRect();
            return {text: el.textContent.trim(), scroll: el.scrollWidth, client: el.clientWidth,
                    left: r.left, right: r.right, barLeft: bar.left, barRight: bar.right};
        }""",
        TAB_BUTTON,
    )
    if label is None:  # 1.32.9 shows no labels: the icon and its tooltip
        return
    assert label["text"] == "Devices", label
    assert label["scroll"] <= label["client"] + 1, label
    assert label["barLeft"] - 0.5 <= label["left"] and label["right"] <= label["barRight"] + 0.5, label


def assert_what_the_run_showed(seen: list[dict[str, Any]], titles: dict[str, str]) -> None:
    """While the prompt ran the panel named the running node by its title, and its move actions were disabled with
    the reason as their tooltip; once it ended they were enabled again."""
    running = [s for s in seen if s["busy"]]
    assert running and all(s["reason"] == BUSY_REASON for s in running), running[:3]
    assert seen[-1]["busy"] is False and seen[-1]["reason"] != BUSY_REASON, seen[-1]
    named = [m.groups() for s in seen if (m := re.search(r"running (.+) \(#(\d+)\)$", s["status"]))]
    assert named and all(titles[node] == title for title, node in named), named
    assert not [s["status"] for s in seen if "running node" in s["status"]]


def test_panel_shows_the_simulated_device_and_follows_a_run(frontend, artifacts, frontend_version):
    idle = _profile_status(frontend) == 404
    page = open_panel(frontend)
    served = page.evaluate("window.__COMFYUI_FRONTEND_VERSION__")
    assert served == (RELEASES[DEFAULT_VERSION].frontend if frontend_version == PINNED else frontend_version)
    row = page.locator(GPU_ROW)
    assert int(row.get_attribute("data-total")) == 8 * GIB
    assert "Simulated GPU 0" in row.inner_text()
    assert page.locator(f'{PANEL} .dc-device[data-device="cpu"]').count() == 1
    # The simulated GPU, like the CPU, cannot tell its utilisation and temperature: the panel says so.
    assert row.locator(".dc-gauges").inner_text() == "utilisation and temperature: not reported"
    assert_tab_label_fits(page)
    if idle:  # no run yet: the last run's section says so in a sentence
        summary = f"{PANEL} .dc-run-summary"
        page.wait_for_function("(s) => document.querySelector(s).textContent.startsWith('No run')", arg=summary)
        assert page.locator(summary).inner_text() == NO_RUN_YET

    frontend.server.forget_outputs()  # another module ran the seed on this server: every node must run for its badge
    seen = run_workflow(frontend, SEED)
    titles = {str(n["id"]): n.get("title") or n["type"] for n in json.loads(SEED.read_text())["nodes"]}
    titles.update(page.evaluate("Object.fromEntries(window.app.graph.nodes.map((n) => [String(n.id), n.title]))"))
    assert_what_the_run_showed(seen, titles)
    gpu_use = [s["own"] for s in seen]
    # The seed: Move To GPU puts the UNet on gpu:0, Offload To CPU takes it back before decoding.
    assert max(gpu_use) - gpu_use[0] >= UNET_BYTES * 0.95, gpu_use
    assert gpu_use[-1] <= gpu_use[0] + 64 * 1024**2, gpu_use
    unet_on_gpu = [
        resident for s in seen for name, resident in s["models"] if name.startswith("MODEL") and resident > 0
    ]
    assert unet_on_gpu and max(unet_on_gpu) >= UNET_BYTES * 0.95
    # Offloaded, the UNet leaves ComfyUI's loaded list, and the panel's.
    assert not [name for name, resident in seen[-1]["models"] if name.startswith("MODEL") and resident > 0]

    timeline = page.locator(f"{PANEL} canvas.dc-timeline")
    assert int(timeline.get_attribute("data-markers")) >= 5  # one per node that ran
    assert int(timeline.get_attribute("data-samples")) >= 3
    assert_the_chart_is_readable(page, timeline)

    # The run's profile, pushed to the page at its end: the badges on the canvas and the last run's chart.
    page.wait_for_function("window.__dcProfile", timeout=30_000)
    profile = frontend.server.get("/device_control/profile")
    assert page.evaluate("window.__dcProfile.prompt_id") == profile["prompt_id"]
    assert_run_chart_is_readable(page, PANEL, profile)
    assert_badges_show_the_profile(page, profile)
    # Offload To CPU raised nothing and gave the UNet's bytes back: its badge says what it freed (was "≥ +0 B"),
    # where its readings saw the drop (a run whose reading at its start came late shows it on no device).
    offload, freed = next(n for n in profile["nodes"] if n["node"] == "9"), drawn_badges(page)["9"]["text"]
    if offload["device"] == "gpu:0":
        assert freed.startswith("\u22123.20 GiB gpu:0 · "), freed
    badges = drawn_badges(page, 0.6, (20, 110))  # from the loader to the sampler, at a readable size
    page.screenshot(path=str(artifacts / f"profile_badges_{frontend_version}.png"))
    assert_badges_tell_what_each_node_did(page, profile, badges)
    assert frontend.our_errors() == []
    page.locator(PANEL).screenshot(path=str(artifacts / f"panel_after_seed_run_{frontend_version}.png"))
    frontend.load_workflow(PLACED)  # another workflow, with nodes of the same ids and classes: no badge of the run
    assert drawn_badges(page) == {}


def assert_badges_tell_what_each_node_did(page: Any, profile: dict, badges: dict[str, dict]) -> None:
    """On the seed: Move To GPU raised gpu:0 by the UNet; Empty Latent Image did its little on the CPU; the sampler's
    badge is its own, not the level of the device it ran beside; the profile belongs to the graph shown."""
    nodes = {node["node"]: node for node in profile["nodes"]}
    assert nodes["3"]["device"] == "gpu:0" and nodes["3"]["rise"]["gpu:0"] >= UNET_BYTES * 0.95
    assert " gpu:0 · " in badges["3"]["text"]
    assert nodes["7"]["device"] == "cpu" and " CPU · " in badges["7"]["text"], badges["7"]
    assert nodes["7"]["rise"]["cpu"] < 64 * 1024**2  # a 64x64 latent
    assert badges["8"]["text"] != badges["7"]["text"], (badges["8"], badges["7"])
    assert profile["workflow"] and profile["workflow"] == page.evaluate("(window.app.rootGraph ?? window.app.graph).id")


def _profile_status(frontend: FrontendPage) -> int:
    """The status of the server's latest profile: 200, or 404 while no prompt has run."""
    try:
        frontend.server.get("/device_control/profile")
    except urllib.error.HTTPError as error:
        return error.code
    return 200


def assert_the_chart_is_readable(page: Any, timeline: Any) -> None:
    """At the sidebar's width as the frontend gives it: no text of the chart on another, all of it inside the
    chart, the legend beside no other text, and a marker's node named on hover."""
    box = timeline.bounding_box()
    labels = json.loads(timeline.get_attribute("data-layout"))
    texts = {label["text"] for label in labels}
    assert texts >= {"0%", "50%", "100%", "now"}
    # Node starts are named on the chart where a name lies on no other (they had hover names only).
    assert [text for text in texts if not re.fullmatch(r"\d+%|now|-\d+ s", text)], texts
    assert_labels_readable(labels, box)
    # Measured in one step in the page: the panel re-renders every push, so an entry found first and measured
    # after may be gone by then.
    chart, legend = page.evaluate(
        """(panel) => {
            const box = (e) => {
                const r = e.getBoundingClientRect();
                return {x: r.x, y: r.y, width: r.width, height: r.height};
            };
            const shown = [...document.querySelectorAll(panel + ' .dc-legend-entry')].map(box).filter(b => b.width > 0);
            return [box(document.querySelector(panel + ' canvas.dc-timeline')), shown];
        }""",
        PANEL,
    )
    assert legend and all(b["y"] + b["height"] <= chart["y"] + 0.5 for b in legend)  # above the chart
    # The host's RAM is a line of its own, beside each GPU's.
    assert "RAM" in page.evaluate(
        "(p) => [...document.querySelectorAll(p + ' .dc-legend-entry')].map(e => e.textContent)", PANEL
    )
    assert not any(overlap(a, b) for i, a in enumerate(legend) for b in legend[i + 1 :])
    # The pointer on the last marker, in one step in the page: the chart scrolls with time and redraws at every
    # push, so a marker found first and pointed at after may have moved by then.
    markers, hovered = page.evaluate(
        """(panel) => {
            const canvas = document.querySelector(panel + ' canvas.dc-timeline');
            const markers = JSON.parse(canvas.dataset.markerPositions || '[]');
            if (!markers.length) return [markers, ""];
            const r = canvas.getBoundingClientRect();
            const at = {clientX: r.x + markers[markers.length - 1], clientY: r.y + r.height / 2, bubbles: true};
            canvas.dispatchEvent(new MouseEvent("mousemove", at));
            return [markers, document.querySelector(panel + ' .dc-timeline-node').textContent];
        }""",
        PANEL,
    )
    assert markers, "no marker was drawn"
    assert hovered.startswith("node started: "), hovered


def _last_profile(frontend: FrontendPage) -> dict:
    """The server's last profile; the seed is run first where this server has none (a test run on its own)."""
    try:
        return frontend.server.get("/device_control/profile")
    except urllib.error.HTTPError as error:
        assert error.code == 404, error
    frontend.open()
    run_workflow(frontend, SEED)
    return frontend.server.get("/device_control/profile")


def test_last_run_chart_in_the_bottom_panel_and_its_exports(frontend, artifacts, frontend_version):
    profile = _last_profile(frontend)
    page = open_panel(frontend)  # a new page: the profile comes from the route, not from a push
    sidebar = assert_run_chart_is_readable(page, PANEL, profile)
    page.evaluate("window.app.extensionManager.command.execute('Workspace.ToggleBottomPanelTab.device-control-run')")
    wide = page.locator(".dc-run-wide")
    wide.wait_for(timeout=30_000)
    bottom = assert_run_chart_is_readable(page, ".dc-run-wide", profile)
    assert bottom["width"] > 1.5 * sidebar["width"], (bottom, sidebar)
    wide.screenshot(path=str(artifacts / f"profile_bottom_panel_{frontend_version}.png"))

    files = {}
    for kind in ("json", "markdown", "png"):
        with page.expect_download() as download:
            wide.locator(f".dc-export-{kind}").click()
        files[kind] = (download.value.suggested_filename, Path(download.value.path()).read_bytes())
    stem = f"device_control_profile_{profile['prompt_id']}"
    assert [name for name, _ in files.values()] == [f"{stem}.json", f"{stem}.md", f"{stem}_timeline.png"]
    assert json.loads(files["json"][1]) == profile
    markdown = files["markdown"][1].decode()
    assert markdown.startswith(f"Prompt {profile['prompt_id']} (success") and "| KSampler (8) | KSampler |" in markdown
    png = files["png"][1]
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (1200, 300)
    (artifacts / f"profile_export_{frontend_version}.png").write_bytes(png)
    # A run that used no GPU: the badge names the CPU, and what the node raised the process's RAM by.
    cpu_only = {
        "nodes": [
            {
                **node,
                "before": {"cpu": 1024**3},
                "after": {"cpu": 1024**3},
                "peak": {"cpu": 2 * 1024**3},
                "rise": {"cpu": 1024**3},
                "device": "cpu",
                "peak_bounded": ["cpu"],
            }
            for node in profile["nodes"]
            if node["node"] == "8"
        ],
        "heaviest": {"node": "8", "device": "cpu"},
    }
    text = page.evaluate(
        "async ([path, p]) => [...(await import(path + 'panel/badges.js')).nodeBadges(p, false).values()][0].text",
        [OUR_EXTENSION_PATH, cpu_only],
    )
    assert text.startswith("▲ ≥ +1.00 GiB CPU · ") and text.endswith(seconds(cpu_only["nodes"][0]["wall"])), text
    assert frontend.our_errors() == []


def test_offload_button_moves_a_model_back_to_ram(frontend, artifacts, frontend_version):
    page = open_panel(frontend)
    run_workflow(frontend, PLACED)
    unet = page.locator(f"{PANEL} .dc-model", has_text="MODEL SD15 diffusion model")
    page.wait_for_function(
        """() => [...document.querySelectorAll('.device-control-panel .dc-model')]
            .some((m) => m.textContent.startsWith('MODEL') && Number(m.dataset.resident) > 0)"""
    )
    assert int(unet.get_attribute("data-resident")) >= UNET_BYTES * 0.95
    own_before = int(page.locator(GPU_ROW).get_attribute("data-own"))
    badge = page.locator(TAB_BUTTON).first
    assert re.search(r"(^|\s)40%", badge.inner_text())  # the meter on the tab's icon: 3.2 of 8 GiB used
    # Which device the meter measures: in the tab's tooltip (the button's label where the frontend gives one).
    tooltip = page.evaluate(
        "window.app.extensionManager.sidebarTab.sidebarTabs.find((t) => t.id === 'device-control').tooltip"
    )
    assert tooltip.endswith(" · gpu:0 40% used"), tooltip
    label = badge.get_attribute("aria-label")
    assert label is None or label.endswith("gpu:0 40% used"), label
    page.set_viewport_size({"width": 1800, "height": 1100})
    page.screenshot(path=str(artifacts / f"panel_with_placed_unet_{frontend_version}.png"))

    click_and_confirm(page, unet.locator(".dc-offload"))
    page.wait_for_function(
        """() => [...document.querySelectorAll('.device-control-panel .dc-model')]
            .filter((m) => m.textContent.startsWith('MODEL')).every((m) => Number(m.dataset.resident) === 0)""",
        timeout=30_000,
    )
    own_after = int(page.locator(GPU_ROW).get_attribute("data-own"))
    assert own_before - own_after >= UNET_BYTES * 0.95
    page.wait_for_function(
        "([selector]) => /(^|\\s)0%/.test(document.querySelector(selector).innerText)", arg=[TAB_BUTTON]
    )
    snapshot = frontend.server.get("/device_control/snapshot")
    gpu = next(d for d in snapshot["report"]["devices"] if d["id"] == "gpu:0")
    assert gpu["torch_allocated"] < 64 * 1024**2
    assert frontend.our_errors() == []


def test_copy_report_and_settings(frontend):
    frontend.page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page = open_panel(frontend)
    page.locator(f"{PANEL} .dc-copy").click()
    page.wait_for_timeout(500)
    text = page.evaluate("navigator.clipboard.readText()")
    assert text.startswith("# Device Control memory report")
    data = json.loads(text.split("```json", 1)[1].split("```", 1)[0])
    assert {"## Versions", "## ComfyUI memory mode", "## Devices", "## Models"} <= set(text.splitlines())
    report = data["snapshot"]["report"]
    assert {"versions", "devices", "models", "mode"} <= set(report)
    assert any(d["id"] == "gpu:0" for d in report["devices"])
    assert "--cpu" in data["snapshot"]["flags"]
    assert {"samples", "markers"} <= set(data["timeline"])

    assert "2^30 bytes" in page.locator(f"{PANEL} .dc-units").inner_text()  # binary, as budgets count
    # Showing one device only, in decimal units.
    page.evaluate(
        """async () => {
            await window.app.extensionManager.setting.set('DeviceControl.Panel.Devices', 'cpu');
            await window.app.extensionManager.setting.set('DeviceControl.Panel.Units', 'decimal (GB)');
        }"""
    )
    page.locator(f"{PANEL} .dc-refresh").click()
    page.wait_for_function("!document.querySelector('.device-control-panel .dc-device[data-device=\"gpu:0\"]')")
    assert " GB" in page.locator(f'{PANEL} .dc-device[data-device="cpu"]').inner_text()
    # Decimal GB is not what a budget's GB means: the panel says which its figures are.
    assert page.locator(f"{PANEL} .dc-units").inner_text() == UNITS_DECIMAL
    # Refresh 0: this page ends its subscription (pages of earlier tests may hold theirs a few seconds more).
    listeners = frontend.server.get("/device_control/snapshot")["push"]["listeners"]
    page.evaluate("window.app.extensionManager.setting.set('DeviceControl.Panel.RefreshSeconds', 0)")
    page.wait_for_timeout(500)
    assert frontend.server.get("/device_control/snapshot")["push"]["listeners"] <= listeners - 1
    page.evaluate(
        """async () => {
            const s = window.app.extensionManager.setting;
            await s.set('DeviceControl.Panel.Devices', 'all');
            await s.set('DeviceControl.Panel.Units', 'binary (GiB)');
            await s.set('DeviceControl.Panel.RefreshSeconds', 1);
        }"""
    )
    assert frontend.our_errors() == []


def test_a_run_pushed_before_the_pages_first_answer_keeps_its_badges(frontend):
    """The page asks for the latest profile when it opens; where that answer comes after a run's push (a slow
    server), the page keeps the run it was pushed: the badges are its figures, not the answer's older ones."""
    frontend.server.forget_outputs()  # an earlier test ran this workflow here: every node must run for its badge
    held: list[Any] = []
    frontend.page.route("**/device_control/profile", lambda route: held.append(route))  # the first GET waits here
    page = open_panel(frontend)
    run_workflow(frontend, PLACED)
    pushed = page.evaluate("window.__dcProfile")
    assert held, "the page did not ask for the latest profile when it opened"
    older = {**pushed, "prompt_id": "an-older-run", "nodes": [{**n, "wall": n["wall"] + 5} for n in pushed["nodes"]]}
    held[0].fulfill(status=200, content_type="application/json", body=json.dumps(older))
    page.wait_for_timeout(500)
    assert_badges_show_the_profile(page, pushed)
