"""Write the example workflows of our nodes (UI format, as the frontend saves them).

The graphs are described in a few lines each (``tools.templates.graphs``) and laid out as the frontend stores them
(node inputs, outputs, links, widget values), against a running ComfyUI's ``/object_info``; the browser tests then check
that the real frontend loads each file and turns it into the same prompt as ``tools.templates.workflow_api``.

The files are for users: each names the released model files (``tools.templates.models``), carries the frontend's
model metadata on its loaders (``properties.models``: name, url, directory, which the missing-model dialog offers to
download) and samples at settings that give a real image. The graphs are written on the test fixtures and
released by ``tools.templates.release.release``; the four hand-made SD1.5 files (``02_``, ``03_``, ``05_`` and
``06_``, not built here) are released and laid out the same way. Nodes are packed in columns from the sizes written,
so none overlaps (``tests/browser/test_templates.py`` checks the frontend's own rectangles).

Run ``python3 tools/templates/make_workflows.py`` after changing a graph or a node's inputs, and commit the files.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.runtime.server import ComfyServer
from tools.templates.families import NOTE_SIZE
from tools.templates.graphs import WORKFLOWS, Node
from tools.templates.release import release

log = logging.getLogger("device_control.tools")
REPO = Path(__file__).resolve().parents[2]
NODE_WIDTH, REPORT_SIZE, GAP, OUR_TEXT_BOX, TITLE_HEIGHT = 340, (520, 360), 50, 160, 30
#: The view a template opens at: its start (top left), at a zoom where the frontend draws node text (it draws bare
#: boxes below 8 px over its 14 px text, 0.57, on a screen of device pixel ratio 1). The frontends that fit a
#: template to the window (1.45 on) would open a graph of a dozen nodes at about 30 %: the pack's extension
#: (web/template_view.js) opens a graph marked with TEMPLATE_MARK at this view instead, where the fit draws no text.
OPEN_SCALE, OPEN_MARGIN, TEMPLATE_MARK = 0.75, 30, "device_control_template"


def _inputs(info: dict[str, Any]) -> list[tuple[str, list[Any], bool]]:
    found = []
    for section in ("required", "optional"):
        specs = info["input"].get(section, {})
        for name in info.get("input_order", {}).get(section, list(specs)):
            found.append((name, specs[name], section == "optional"))
    return found


def _type_of(spec: list[Any]) -> str:
    return "COMBO" if isinstance(spec[0], list) or spec[0] == "COMBO" else str(spec[0])


def _is_widget(spec: list[Any]) -> bool:
    options = (spec[1] if len(spec) > 1 else {}) or {}
    return not options.get("forceInput") and _type_of(spec) in {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


def _order(nodes: list[Node]) -> dict[int, int]:
    done: dict[int, int] = {}
    pending = {n.id: n for n in nodes}
    while pending:
        ready = sorted(i for i, n in pending.items() if all(src in done for src, _ in n.links.values()))
        for node_id in ready:
            done[node_id] = len(done)
            del pending[node_id]
    return done


def build(nodes: list[Node], object_info: dict[str, Any]) -> dict[str, Any]:
    """The UI-format workflow for ``nodes``."""
    links: list[list[Any]] = []
    incoming: dict[tuple[int, str], list[Any]] = {}  # (node id, input name) -> its link
    outgoing: dict[tuple[int, int], list[int]] = {}
    order = _order(nodes)
    by_id = {n.id: n for n in nodes}
    for node in nodes:
        if node.type == "Note":
            continue
        for slot, (name, _spec, _optional) in enumerate(_inputs(object_info[node.type])):
            if name in node.links:
                source, source_slot = node.links[name]
                kind = object_info[by_id[source].type]["output"][source_slot]
                link = [len(links) + 1, source, source_slot, node.id, slot, kind]
                links.append(link)
                incoming[(node.id, name)] = link
                outgoing.setdefault((source, source_slot), []).append(link[0])
    out_nodes = []
    for node in sorted(nodes, key=lambda n: n.id):
        if node.type == "Note":  # the frontend's own note: no inputs, no outputs, never sent to the server
            out_nodes.append(_note(node, order[node.id]))
            continue
        info = object_info[node.type]
        inputs = []
        for name, spec, optional in _inputs(info):
            entry: dict[str, Any] = {"localized_name": name, "name": name}
            if optional:
                entry["shape"] = 7
            entry["type"] = _type_of(spec)
            if _is_widget(spec) and name not in node.links:
                entry["widget"] = {"name": name}
            link = incoming.get((node.id, name))
            entry["link"] = link[0] if link else None
            inputs.append(entry)
        outputs = [
            {
                "localized_name": out_name,
                "name": out_name,
                "type": kind,
                "slot_index": slot,
                "links": outgoing.get((node.id, slot), []),
            }
            for slot, (kind, out_name) in enumerate(zip(info["output"], info["output_name"], strict=True))
        ]
        is_report = node.type == "DeviceControl_VRAMReport"
        record: dict[str, Any] = {
            "id": node.id,
            "type": node.type,
            "pos": list(node.pos),
            "size": list(REPORT_SIZE) if is_report else [NODE_WIDTH, 260],
            "flags": {},
            "order": order[node.id],
            "mode": 0,
            "inputs": inputs,
            "outputs": outputs,
        }
        if node.title:
            record["title"] = node.title
        record["properties"] = {"Node name for S&R": node.type}
        record["widgets_values"] = node.widgets
        out_nodes.append(record)
    return {
        "last_node_id": max(n.id for n in nodes),
        "last_link_id": len(links),
        "nodes": out_nodes,
        "links": links,
        "groups": [],
        "config": {},
        "extra": {},
        "version": 0.4,
    }


def _note(node: Node, order: int) -> dict[str, Any]:
    return {
        "id": node.id,
        "type": "Note",
        "pos": list(node.pos),
        "size": list(NOTE_SIZE),
        "flags": {},
        "order": order,
        "mode": 0,
        "inputs": [],
        "outputs": [],
        **({"title": node.title} if node.title else {}),
        "properties": {},
        "widgets_values": node.widgets,
        "color": "#432",
        "bgcolor": "#653",
    }


def _size(node: dict[str, Any], object_info: dict[str, Any]) -> list[int]:
    """A size at least the frontend's own for this node (title, slot rows, widget rows, text boxes)."""
    if node["type"] == "Note":
        return list(NOTE_SIZE)
    if node["type"] == "DeviceControl_VRAMReport":
        return list(REPORT_SIZE)
    linked = {i["name"] for i in node.get("inputs", []) if i.get("link") is not None}
    slots, widgets, text = 0, 0, 0
    for name, spec, _optional in _inputs(object_info[node["type"]]):
        if not _is_widget(spec) or name in linked:
            slots += 1
        elif _type_of(spec) == "STRING" and ((spec[1] if len(spec) > 1 else {}) or {}).get("multiline"):
            text += 1
        else:
            options = (spec[1] if len(spec) > 1 else {}) or {}
            widgets += 2 if options.get("control_after_generate") else 1
    rows = max(slots, len(node.get("outputs", [])))
    report_box = OUR_TEXT_BOX if node["type"].startswith("DeviceControl_") else 0  # each node of ours reports in one
    return [NODE_WIDTH, 46 + 24 * rows + 28 * widgets + 130 * text + report_box]


def _reports(workflow: dict[str, Any]) -> dict[int, int]:
    """Each VRAM Report on a wire from a node that is not a report: the id of that node, by the report's."""
    source = {link[0]: link[1] for link in workflow["links"]}
    kinds = {node["id"]: node["type"] for node in workflow["nodes"]}
    found = {}
    for node in workflow["nodes"]:
        if node["type"] != "DeviceControl_VRAMReport":
            continue
        link = next((entry.get("link") for entry in node.get("inputs", []) if entry["name"] == "value"), None)
        if link in source and kinds[source[link]] != "DeviceControl_VRAMReport":
            found[node["id"]] = source[link]
    return found


def layout(workflow: dict[str, Any], object_info: dict[str, Any]) -> dict[str, Any]:
    """Pack the nodes in columns: nodes sharing an x form a column, in the order of their y, each below the one
    before; each column starts right of the widest node of the one before. No two nodes overlap, and a VRAM Report
    shares the column of the node it follows, so the graph reads left to right. The workflow opens at its start
    (``OPEN_SCALE``)."""
    place = {node["id"]: (int(node["pos"][0]), float(node["pos"][1])) for node in workflow["nodes"]}
    for report, source in _reports(workflow).items():  # right below the node it follows
        place[report] = (place[source][0], place[source][1] + 0.5)
    columns: dict[int, list[dict[str, Any]]] = {}
    for node in workflow["nodes"]:
        node["size"] = _size(node, object_info)
        columns.setdefault(place[node["id"]][0], []).append(node)
    x = 20
    for _, column in sorted(columns.items()):
        y = 80
        for node in sorted(column, key=lambda n: place[n["id"]][1]):
            node["pos"] = [x, y]
            y += node["size"][1] + GAP
        x += max(n["size"][0] for n in column) + GAP
    left = min(n["pos"][0] for n in workflow["nodes"])
    top = min(n["pos"][1] for n in workflow["nodes"]) - TITLE_HEIGHT
    extra = workflow.setdefault("extra", {})
    extra["ds"] = {"scale": OPEN_SCALE, "offset": [OPEN_MARGIN / OPEN_SCALE - left, OPEN_MARGIN / OPEN_SCALE - top]}
    extra[TEMPLATE_MARK] = True
    return workflow


def _write(path: Path, workflow: dict[str, Any], object_info: dict[str, Any]) -> None:
    path.write_text(json.dumps(layout(release(workflow), object_info), indent=2) + "\n")
    log.info("[Device Control] wrote %s", path.relative_to(REPO))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as base:
        server = ComfyServer(Path(base), env={"DEVICE_CONTROL_SIMULATE_GPU": "8GiB"}).start()
        try:
            object_info = server.get("/object_info")
        finally:
            server.stop()
    for name, graph in WORKFLOWS.items():
        _write(REPO / "workflows" / name, build(graph(), object_info), object_info)
    for path in sorted((REPO / "workflows").glob("*.json")):
        if path.name not in WORKFLOWS:  # made by hand: released and laid out the same way
            _write(path, json.loads(path.read_text()), object_info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
