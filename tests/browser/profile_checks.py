"""What the browser tests check of the memory profile in the frontend: the badges drawn on the canvas after a run
(the numbers of GET /device_control/profile), and the last run's chart (no text over other text, every node a
band, every model event a marker, both named on hover)."""

from __future__ import annotations

import json
from typing import Any

from tests.browser.conftest import OUR_EXTENSION_PATH

BADGES_SETTING = "DeviceControl.Profile.Badges"

#: Keep, as ``window.__dcProfile``, the profile of the page's own next run. A prompt queued over the API has no
#: client: ComfyUI sends it no end, so its profile goes out to the panels when the next prompt starts or the server
#: sees it idle, and can reach the page after the listener is set. The page's own prompts are those whose
#: ``execution_start`` it was sent.
LISTEN_FOR_OWN_PROFILE = """() => {
    window.__dcProfile = null;
    const own = new Set();
    window.app.api.addEventListener("execution_start", (e) => own.add(e.detail?.prompt_id));
    window.app.api.addEventListener("device_control.profile", (e) => {
        if (own.has(e.detail?.prompt_id)) window.__dcProfile = e.detail;
    });
}"""


def seconds(value: float) -> str:
    """The panel's format of a duration (web/panel/format.js ``seconds``)."""
    return f"{round(value * 1000)} ms" if value < 1 else f"{value:.{1 if value < 10 else 0}f} s"


def drawn_badges(page: Any, scale: float = 0.45, offset: tuple[int, int] = (40, 120)) -> dict[str, dict]:
    """Show the workflow at ``scale`` (the whole example at the default), redraw the canvas, and return the badges
    drawn, by node id (graph coordinates)."""
    return page.evaluate(
        """async ([path, scale, offset]) => {
            const badges = await import(path + "panel/badges.js");
            badges.drawn.clear();
            const canvas = window.app.canvas;
            canvas.ds.scale = scale;
            canvas.ds.offset[0] = offset[0];
            canvas.ds.offset[1] = offset[1];
            canvas.setDirty(true, true);
            canvas.draw(true, true);
            return Object.fromEntries(badges.drawn);
        }""",
        [OUR_EXTENSION_PATH, scale, list(offset)],
    )


def format_bytes(value: int) -> str:
    """The panel's format of a size in binary units (web/panel/format.js ``formatBytes``)."""
    size, unit = float(value), 0
    while size >= 1024 and unit < 4:
        size, unit = size / 1024, unit + 1
    return f"{round(size)} B" if unit == 0 else f"{size:.2f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][unit]}"


def rise_text(node: dict) -> str:
    """The badge's memory: what the node raised its device's level by, on that device ("CPU" for the host), after
    a "≥" where the profile knows only a lower bound of more than nothing; what it freed (a minus sign and the
    bytes) where it raised nothing on an accelerator and ended at least 1 MiB lower than it started."""
    device = node["device"]
    rise = node["rise"].get(device, 0)
    change = node.get("after", {}).get(device, 0) - node.get("before", {}).get(device, 0)
    name = "CPU" if device == "cpu" else device
    if device != "cpu" and rise <= 0 and -change >= 1024**2:
        return f"\u2212{format_bytes(-change)} {name}"
    at_least = "≥ " if rise > 0 and device in node.get("peak_bounded", []) else ""
    return f"{at_least}+{format_bytes(rise)} {name}"


def assert_badges_show_the_profile(page: Any, profile: dict) -> None:
    """Every node that ran has a badge with what it raised memory by, on the device it computed on, and its time
    from the route, drawn above its title; only the heaviest node's is marked, and only where one node raised
    memory most, alone; the setting hides them all and shows them again."""
    badges = drawn_badges(page)
    ran = [node for node in profile["nodes"] if node["status"] == "executed"]
    assert ran and {node["node"] for node in ran} <= set(badges), (sorted(badges), [n["node"] for n in ran])
    title_height = page.evaluate("window.LiteGraph?.NODE_TITLE_HEIGHT ?? 30")
    heaviest = (profile["heaviest"] or {}).get("node")
    rises = sorted((node["rise"][node["device"]] for node in ran), reverse=True)
    assert (heaviest is not None) == (rises[0] > 0 and (len(rises) == 1 or rises[1] < rises[0])), rises
    last = {node["node"]: node for node in ran}  # a node run twice in one prompt: its badge is its last run's
    for node in last.values():
        badge = badges[node["node"]]
        records = [record for record in profile["nodes"] if record["node"] == node["node"]]
        assert rise_text(node) in badge["text"] and badge["text"].endswith(seconds(node["wall"])), (badge, records)
        position = page.evaluate("(id) => window.app.graph.getNodeById(Number(id)).pos", node["node"])
        assert badge["y"] + badge["height"] <= position[1] - title_height, (badge, position)
        assert badge["text"].startswith("▲") == (node["node"] == heaviest), badge
        if node["node"] == heaviest:
            assert node["rise"][node["device"]] == rises[0], (node, rises)
    page.evaluate("(id) => window.app.extensionManager.setting.set(id, false)", BADGES_SETTING)
    assert drawn_badges(page) == {}
    page.evaluate("(id) => window.app.extensionManager.setting.set(id, true)", BADGES_SETTING)
    assert set(drawn_badges(page)) == set(badges)


def overlap(a: dict, b: dict) -> bool:
    """Whether two boxes ({x, y, width, height}) share any area."""
    return (
        a["x"] < b["x"] + b["width"]
        and b["x"] < a["x"] + a["width"]
        and a["y"] < b["y"] + b["height"]
        and (b["y"] < a["y"] + a["height"])
    )


def assert_labels_readable(labels: list[dict], box: dict) -> None:
    """Every text label a chart reports drawing (``data-layout``) lies inside the chart's ``box`` and on no other."""
    for i, label in enumerate(labels):
        assert label["x"] >= 0 and label["x"] + label["width"] <= box["width"] + 0.5, label
        assert label["y"] >= 0 and label["y"] + label["height"] <= box["height"] + 0.5, label
        clashes = [other["text"] for other in labels[i + 1 :] if overlap(label, other)]
        assert not clashes, f"{label['text']!r} is drawn over {clashes}"


def assert_run_chart_is_readable(page: Any, selector: str, profile: dict) -> dict:
    """The run chart under ``selector``: the profile's prompt, its axes' text inside the chart and never on other
    text, a band per node that ran, a marker per model event, and hover naming both. Returns the chart's box."""
    chart = page.locator(f"{selector} canvas.dc-run-chart")
    page.wait_for_function(
        "([s, id]) => document.querySelector(s + ' canvas.dc-run-chart')?.dataset.prompt === id",
        arg=[selector, profile["prompt_id"]],
    )
    box = chart.bounding_box()
    labels = json.loads(chart.get_attribute("data-layout"))
    assert {"0", "0 s"} <= {label["text"] for label in labels} and any("GiB" in label["text"] for label in labels)
    assert_labels_readable(labels, box)
    bands = json.loads(chart.get_attribute("data-bands"))
    ran = [node for node in profile["nodes"] if node["status"] in ("executed", "failed")]
    assert [band[0] for band in bands] == [node["node"] for node in ran]
    events = json.loads(chart.get_attribute("data-events"))
    assert len(events) == sum(len(node["events"]) for node in ran) > 0
    marked = (profile["heaviest"] or {}).get("node")
    pointed = next((node for node in ran if node["node"] == marked), ran[0])
    band = next(band for band in bands if band[0] == pointed["node"])
    on_band = _hover(page, selector, (band[1] + band[2]) / 2, box["height"] / 2)
    what = f"{pointed['status']}, the heaviest node" if marked else pointed["status"]
    assert on_band.startswith(f"{pointed['title']} (#{pointed['node']}, {what})"), on_band
    on_event = _hover(page, selector, events[0], 6)
    assert " loaded (" in on_event or " moved (" in on_event or " offloaded (" in on_event, on_event
    return box


def _hover(page: Any, selector: str, x: float, y: float) -> str:
    """Point at (x, y) CSS pixels of the chart; the line under it."""
    return page.evaluate(
        """([s, x, y]) => {
            const canvas = document.querySelector(s + ' canvas.dc-run-chart');
            const r = canvas.getBoundingClientRect();
            canvas.dispatchEvent(new MouseEvent("mousemove", {clientX: r.x + x, clientY: r.y + y, bubbles: true}));
            return document.querySelector(s + ' .dc-run-hover').textContent;
        }""",
        [selector, x, y],
    )
