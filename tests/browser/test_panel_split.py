"""The live panel on a model split over two simulated GPUs: the model's row shows its part on each device, each
device's row its bytes, and the row's Offload button gives both devices back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.browser.panel_clicks import click_and_confirm
from tests.browser.test_panel import PANEL, open_panel, run_workflow
from tests.passes import ONCE

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "workflows" / "12 Flux dev split across two GPUs.json"
#: Read by the ``browser_server`` fixture: two simulated GPUs.
SIMULATE_GPU = "4GiB,4GiB"
MiB = 1024**2
#: The panel's code is the same on every ComfyUI; the frontends each version pins run the single-GPU panel tests.
pytestmark = ONCE


def _own(page: Any, device: str) -> int:
    return int(page.locator(f'{PANEL} .dc-device[data-device="{device}"]').get_attribute("data-own"))


def test_a_split_model_shows_its_parts_per_device_and_offload_gives_both_gpus_back(frontend, artifacts):
    page = open_panel(frontend)
    assert page.locator(f'{PANEL} .dc-device[data-device="gpu:1"]').count() == 1
    before = {device: _own(page, device) for device in ("gpu:0", "gpu:1")}
    run_workflow(frontend, EXAMPLE)
    row = page.locator(f"{PANEL} .dc-model", has_text="MODEL Flux")
    page.wait_for_function(
        """() => [...document.querySelectorAll('.device-control-panel .dc-model')].some((m) =>
            m.textContent.startsWith('MODEL') && Object.keys(JSON.parse(m.dataset.parts || '{}')).length === 2)"""
    )
    parts = json.loads(row.get_attribute("data-parts"))
    assert set(parts) == {"gpu:0", "gpu:1"} and all(size > 100 * MiB for size in parts.values()), parts
    # The report the panel draws from: the same bytes, the split named in its budget.
    snapshot = frontend.server.get("/device_control/snapshot")
    model = next(m for m in snapshot["report"]["models"] if m["component"] == "MODEL")
    assert {d: n for d, n in model["resident"].items() if d != "cpu"} == parts
    assert model["budget"].startswith("split (pipeline): gpu:0 ")
    text = row.inner_text()
    assert "split: " in text and " on gpu:0" in text and " on gpu:1" in text, text
    assert row.locator(".dc-resident.dc-on-gpu-0").count() == 1 and row.locator(".dc-on-gpu-1").count() == 1
    assert _own(page, "gpu:1") - before["gpu:1"] >= parts["gpu:1"]  # the device row counts the part there
    page.locator(PANEL).screenshot(path=str(artifacts / "panel_with_split_model.png"))

    click_and_confirm(page, row.locator(".dc-offload"))
    page.wait_for_function(
        """() => ![...document.querySelectorAll('.device-control-panel .dc-model')]
            .some((m) => m.textContent.startsWith('MODEL') && m.dataset.parts !== '{}')""",
        timeout=30_000,
    )
    books = {
        d["id"]: d["torch_allocated"] for d in frontend.server.get("/device_control/snapshot")["report"]["devices"]
    }
    assert books["gpu:1"] == 0, books  # (the VAE stays on gpu:0)
    assert _own(page, "gpu:1") <= before["gpu:1"] + 16 * MiB
    assert frontend.our_errors() == []
