"""Convert a workflow saved by ComfyUI's frontend (UI format) into the API format ``POST /prompt`` takes.

The frontend does this in the browser (``graphToPrompt``); we do the same in Python so tests and the
demo can run the very files users open. The browser tests check that both conversions agree.

Rules (those of the frontend): widget values are stored in ``widgets_values`` in the order of the node's
widget inputs (``input_order`` in ``/object_info``); an INT or COMBO input flagged
``control_after_generate`` stores one extra value after its own (the "fixed/randomize" choice), which is
not an input; a linked input becomes ``[origin_node_id, origin_slot]``; ``Reroute`` nodes are followed
through; notes are dropped; muted nodes are left out.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from tools.templates.models import (
    FIXTURE_CFG,
    FIXTURE_FRAMES,
    FIXTURE_SIZE,
    FIXTURE_STEPS,
    MODELS,
    TEXT_ENCODER_FIXTURES,
)

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
NOTE_TYPES = {"Note", "MarkdownNote"}
MODE_MUTED, MODE_BYPASSED = 2, 4


class WorkflowError(ValueError):
    """The workflow cannot be converted; the message names the node and what to change."""


def _is_widget(spec: list[Any]) -> bool:
    kind, options = spec[0], (spec[1] if len(spec) > 1 else {}) or {}
    if options.get("forceInput"):
        return False
    return isinstance(kind, list) or kind in WIDGET_TYPES


def _widget_inputs(info: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for section in ("required", "optional"):
        specs = info["input"].get(section, {})
        for name in info.get("input_order", {}).get(section, list(specs)):
            spec = specs[name]
            if _is_widget(spec):
                found.append((name, (spec[1] if len(spec) > 1 else {}) or {}))
    return found


def ui_to_api(workflow: dict[str, Any], object_info: dict[str, Any]) -> dict[str, Any]:
    """Convert a UI-format workflow into an API-format prompt.

    Args:
        workflow: the workflow JSON as the frontend saves it.
        object_info: the server's ``GET /object_info`` answer.

    Raises:
        WorkflowError: a node type is unknown to the server, or the workflow uses what we cannot convert.
    """
    nodes = {node["id"]: node for node in workflow["nodes"]}
    links = {link[0]: link for link in workflow.get("links", [])}

    def origin(link_id: int) -> list[Any] | None:
        _, source_id, source_slot, *_ = links[link_id]
        source = nodes[source_id]
        if source["type"] == "Reroute":
            upstream = source["inputs"][0].get("link")
            return origin(upstream) if upstream is not None else None
        if source.get("mode") == MODE_MUTED:
            return None
        return [str(source_id), source_slot]

    prompt: dict[str, Any] = {}
    for node in sorted(workflow["nodes"], key=lambda n: n["id"]):
        kind = node["type"]
        if kind in NOTE_TYPES or kind == "Reroute" or node.get("mode") == MODE_MUTED:
            continue
        if node.get("mode") == MODE_BYPASSED:
            raise WorkflowError(f"node {node['id']} ({kind}) is bypassed; un-bypass or remove it before converting.")
        if kind not in object_info:
            raise WorkflowError(
                f"node {node['id']} has type {kind!r}, which this server does not know; "
                "install the pack that provides it."
            )
        values = node.get("widgets_values") or []
        if not isinstance(values, list):
            raise WorkflowError(f"node {node['id']} ({kind}) stores its widgets as a mapping; only lists convert.")
        inputs: dict[str, Any] = {}
        position = 0
        for name, options in _widget_inputs(object_info[kind]):
            if position < len(values):
                inputs[name] = values[position]
            position += 1
            if options.get("control_after_generate"):
                position += 1
        for socket in node.get("inputs", []):
            if socket.get("link") is not None:
                source = origin(socket["link"])
                if source is not None:
                    inputs[socket["name"]] = source
        prompt[str(node["id"])] = {"class_type": kind, "inputs": inputs, "_meta": {"title": node.get("title") or kind}}
    return prompt


#: Latent nodes whose first two widgets are width and height (a video latent's third is its length in frames).
LATENT_TYPES = {"EmptyLatentImage", "EmptySD3LatentImage", "EmptyHunyuanLatentVideo"}
SAMPLER_TYPES = {"KSampler"}


def _fixture_widgets(kind: str, values: list[Any]) -> list[Any]:
    values = [MODELS[v].fixture if isinstance(v, str) and v in MODELS else v for v in values]
    if kind == "DeviceControl_LoadTextEncoders" and values[4] in TEXT_ENCODER_FIXTURES:
        files, fixture_type = TEXT_ENCODER_FIXTURES[values[4]]
        values[:5] = [*files, *["none"] * (4 - len(files)), fixture_type]
    elif kind in LATENT_TYPES:
        values[:2] = [FIXTURE_SIZE, FIXTURE_SIZE]
        if kind == "EmptyHunyuanLatentVideo":
            values[2] = FIXTURE_FRAMES
    elif kind in SAMPLER_TYPES:
        values[2:4] = [FIXTURE_STEPS, FIXTURE_CFG]
    elif kind == "KSamplerAdvanced":  # a share of the steps: two in all, each sampler of a pair taking one
        steps, values[3:5] = values[3], [2 * FIXTURE_STEPS, FIXTURE_CFG]
        values[7] = 0 if values[7] == 0 else FIXTURE_STEPS
        values[8] = values[8] if values[8] >= steps else FIXTURE_STEPS
    return values


def for_fixtures(workflow: dict[str, Any]) -> dict[str, Any]:
    """A copy of an example workflow that runs on the synthetic test models, as fast as the tests need.

    The example workflows name the released files and sample at their real sizes and steps; this swaps each
    file for its fixture (``tools.templates.models``), the text encoders for the fixtures' CLIP-L (and CLIP-G for
    SDXL), latents for 64x64 (five frames), and samplers for one step at cfg 1 (a pair of advanced samplers that
    share the steps, for one each). The download metadata is dropped,
    so the frontend finds nothing missing.
    """
    copied = copy.deepcopy(workflow)
    for node in copied["nodes"]:
        if isinstance(node.get("widgets_values"), list):
            node["widgets_values"] = _fixture_widgets(node["type"], node["widgets_values"])
        node.get("properties", {}).pop("models", None)
    return copied


def load_workflow(path: Path) -> dict[str, Any]:
    """An example workflow file as the tests, the demo and the thumbnails run it: on the fixtures
    (:func:`for_fixtures`)."""
    return for_fixtures(json.loads(Path(path).read_text()))
