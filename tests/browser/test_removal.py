"""Removing the pack leaves the frontend as it was: the page equals that of a ComfyUI that never had the pack.

A user who used the panel (its settings saved in their ComfyUI user folder) and then deletes the pack must get
the stock frontend back: no tab, no setting, no node type, no element of ours, and no console message that a
stock ComfyUI would not print too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.browser.conftest import FrontendPage
from tests.browser.test_panel import open_panel
from tests.passes import ONCE
from tools.runtime.provision import PACK_FOLDER
from tools.runtime.server import ComfyServer

# What the page shows of its extensions, sidebar tabs, settings and node types, and any element of ours.
PAGE_STATE = """() => {
    const manager = window.app.extensionManager;
    const settings = manager?.setting?.settings ?? {};
    return {
        extensions: window.app.extensions.map((e) => e.name).sort(),
        tabs: (manager?.sidebarTab?.sidebarTabs ?? []).map((t) => t.id).sort(),
        settings: Object.keys(settings).sort(),
        nodes: Object.keys(window.LiteGraph.registered_node_types).sort(),
        ours: document.querySelectorAll('[class*="device-control"], [class*="dc-"]').length,
    };
}"""


def _without_pack(base: Path) -> ComfyServer:
    """A ComfyUI on ``base`` whose ``custom_nodes/`` no longer holds the pack (as after deleting its folder)."""
    server = ComfyServer(base)
    (server.base / "custom_nodes" / PACK_FOLDER).unlink()
    return server.start()


def _page(browser: Any, server: ComfyServer, panel: bool = False) -> tuple[dict[str, Any], list[str]]:
    """Open the frontend once (and the Device Control tab if ``panel``); its state and its console errors."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    try:
        page = FrontendPage(context.new_page(), server)
        if panel:
            open_panel(page)
        else:
            page.open()
        page.page.wait_for_timeout(1500)  # late extension set-up and first websocket messages
        state = page.page.evaluate(PAGE_STATE)
        # Stock frontends print errors of their own (e.g. remote resources): compared without the port.
        errors = sorted(
            m["text"].replace(server.url, "SERVER") for m in page.console if m["type"] in ("error", "pageerror")
        )
        return state, errors
    finally:
        context.close()


# Once, in the primary pass: with the pack's folder gone none of its code runs; only how a frontend treats the
# panel's settings left in the user folder could differ between versions, and that is checked on this one's.
@ONCE
def test_removing_the_pack_gives_back_the_stock_frontend(browser, comfy_factory, tmp_path_factory):
    # A ComfyUI that never had the pack: the reference.
    stock = _without_pack(tmp_path_factory.mktemp("stock-base"))
    try:
        stock.post("/settings/Comfy.TutorialCompleted", True)
        expected, stock_errors = _page(browser, stock)
    finally:
        stock.stop()

    # A user's ComfyUI with the pack, its panel used and every setting of ours changed ...
    used = comfy_factory(tmp_path_factory.mktemp("used-base"), env={"DEVICE_CONTROL_SIMULATE_GPU": "8GiB"})
    try:
        used.post("/settings/Comfy.TutorialCompleted", True)
        with_pack, _ = _page(browser, used, panel=True)
        ours = sorted(set(with_pack["settings"]) - set(expected["settings"]))
        assert ours and all(key.startswith("DeviceControl.") for key in ours), ours
        for key, value in (
            ("DeviceControl.Panel.RefreshSeconds", 2),
            ("DeviceControl.Panel.Units", "decimal (GB)"),
            ("DeviceControl.Panel.Devices", "cpu"),
        ):
            used.post(f"/settings/{key}", value)
        assert {"DeviceControl.NodeText", "DeviceControl.Panel"} <= set(with_pack["extensions"])
        assert set(with_pack["tabs"]) > set(expected["tabs"])
        assert any(node.startswith("DeviceControl_") for node in with_pack["nodes"])
    finally:
        used.stop()

    # ... then the pack deleted and ComfyUI started again on the same user folder.
    removed = _without_pack(used.base)
    try:
        state, errors = _page(browser, removed)
    finally:
        removed.stop()
    assert state == expected
    assert errors == stock_errors
    assert not [e for e in errors if "device" in e.lower() and "control" in e.lower()]
