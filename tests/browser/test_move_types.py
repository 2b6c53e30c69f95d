"""In the real editor, Move To GPU's model output takes the type of what is connected to its input (a CLIP in, a CLIP
out), so the editor refuses to wire a moved CLIP into a KSampler's model input; what ComfyUI lists for the node, and
its Info shows, reads every type it takes (:data:`TAKES`); a moved ControlNet is a CONTROL_NET. Saved workflows
keep their links. A device this machine does not have is a warning the editor shows when the prompt is queued. On
the frontend the running ComfyUI pins (1.32.9 on 0.3.75, 1.45.21 on 0.28.0, 1.48.7 on 0.33.0) and on the newest
served: each frontend a user has is met with the ComfyUI that ships it, and the newest with every ComfyUI (1.45.21
with 0.3.75's and 0.33.0's servers too cost some 110 s of CPU a pass, a page load of the frontend about 7 s each)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.browser.conftest import PINNED
from tests.browser.profile_checks import LISTEN_FOR_OWN_PROFILE, drawn_badges
from tools.runtime.provision import DEFAULT_VERSION, NEWEST_FRONTEND, RELEASES

REPO = Path(__file__).resolve().parents[2]
MOVE = REPO / "workflows" / "01 Start here - SD1.5 moved to the GPU, then offloaded.json"
#: The types Move To GPU's model input takes and its output declares (``nodes.bridge.subjects.PLACEABLE_KINDS``).
TAKES = "MODEL,CLIP,VAE,CONTROL_NET,CLIP_VISION,UPSCALE_MODEL,MODEL_PATCH,GLIGEN"
#: The frontend the running ComfyUI pins, and the newest where that is another.
FRONTENDS = [PINNED, *{NEWEST_FRONTEND} - {RELEASES[DEFAULT_VERSION].frontend}]

pytestmark = pytest.mark.parametrize("frontend_version", sorted(FRONTENDS), indirect=True, scope="module")

#: Builds a graph through the frontend's own graph API: a loader's output into Move To GPU, then Move To GPU's
#: output offered to a KSampler's model input and to a CLIP Text Encode's clip input. Returns what the editor did.
WIRE = """async ([loaderType, outputName, linkFirst]) => {
    const graph = window.app.graph;
    graph.clear();
    const graphId = graph.id;
    const add = (type) => { const node = window.LiteGraph.createNode(type); graph.add(node); return node; };
    const loader = add(loaderType), move = add("DeviceControl_MoveToGPU");
    const sampler = add("KSampler"), encode = add("CLIPTextEncode");
    const frame = () => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)));
    // On a loaded machine the new nodes may take more than a frame to get their inputs: wait for them (two seconds
    // at most), and look the slots up again right before each link.
    for (let i = 0; i < 60 && (sampler.findInputSlot("model") < 0 || encode.findInputSlot("clip") < 0); i++) {
        await frame();
    }
    let modelIn = sampler.findInputSlot("model"), clipIn = encode.findInputSlot("clip");
    const typeBefore = move.outputs[0].type, inputType = move.inputs[0].type;
    // Wired before the input is connected (the output takes any of its types then): connecting a CLIP drops it.
    const early = linkFirst ? !!move.connect(0, sampler, modelIn) : null;
    const fed = !!loader.connect(loader.findOutputSlot(outputName), move, move.findInputSlot("model"));
    await frame();
    await frame();
    const typeAfter = move.outputs[0].type;
    modelIn = sampler.findInputSlot("model");
    clipIn = encode.findInputSlot("clip");
    const keptEarly = linkFirst ? sampler.inputs[modelIn].link != null : null;
    if (sampler.inputs[modelIn].link != null) sampler.disconnectInput(modelIn);
    const toSampler = !!move.connect(0, sampler, modelIn);
    const toEncoder = !!move.connect(0, encode, clipIn);
    const valid = window.LiteGraph.isValidConnection(typeAfter, sampler.inputs[modelIn].type);
    return {typeBefore, inputType, early, fed, typeAfter, keptEarly, toSampler, toEncoder, valid, modelIn, clipIn,
            samplerLinked: sampler.inputs[modelIn].link != null, encoderLinked: encode.inputs[clipIn].link != null,
            // Whether the page replaced this graph meanwhile (a workflow of its own loading late, say).
            attached: [loader, move, sampler, encode].every((node) => node.graph === window.app.graph
                && window.app.graph.getNodeById(node.id) === node), sameGraph: window.app.graph.id === graphId,
            nodes: window.app.graph._nodes.length};
}"""

#: After a workflow was loaded: Move To GPU's output type and how many links leave it.
MOVED_OUTPUT = """() => {
    const move = window.app.graph._nodes.find((n) => n.comfyClass === "DeviceControl_MoveToGPU");
    return {type: move.outputs[0].type, links: (move.outputs[0].links || []).length};
}"""


def _wire(frontend: Any, loader: str, output: str, link_first: bool = False) -> dict[str, Any]:
    wired = frontend.page.evaluate(WIRE, [loader, output, link_first])
    # With what the page printed: the frontend says why it refused a link.
    wired["console"] = [m["text"][:300] for m in frontend.console if m["type"] in ("error", "warning", "pageerror")]
    return wired


@pytest.fixture
def editor(frontend):
    frontend.open()
    return frontend


def test_a_moved_clip_is_a_clip_and_cannot_feed_a_sampler(graph_page):
    wired = _wire(graph_page, "CLIPLoader", "CLIP")
    assert wired["typeBefore"] == wired["inputType"] == TAKES, str(wired)  # readable, as the Info shows it
    assert wired["fed"] and wired["typeAfter"] == "CLIP", str(wired)
    assert wired["valid"] is False and wired["toSampler"] is False and not wired["samplerLinked"], str(wired)
    assert wired["toEncoder"] and wired["encoderLinked"], str(wired)
    assert graph_page.our_errors() == []


def test_a_moved_controlnet_is_a_controlnet_and_feeds_neither_a_sampler_nor_an_encoder(graph_page):
    wired = _wire(graph_page, "ControlNetLoader", "CONTROL_NET")
    assert wired["fed"] and wired["typeAfter"] == "CONTROL_NET", str(wired)
    assert wired["toSampler"] is False and wired["toEncoder"] is False, str(wired)
    assert graph_page.our_errors() == []


def test_a_link_to_a_sampler_made_before_a_clip_is_connected_is_dropped(graph_page):
    wired = _wire(graph_page, "CLIPLoader", "CLIP", link_first=True)
    assert wired["early"] is True, str(wired)  # nothing connected yet: the output takes any of the three
    assert wired["typeAfter"] == "CLIP" and wired["keptEarly"] is False, str(wired)


def test_a_moved_model_still_feeds_a_sampler(graph_page):
    wired = _wire(graph_page, "CheckpointLoaderSimple", "MODEL")
    assert wired["fed"] and wired["typeAfter"] == "MODEL", str(wired)
    assert wired["valid"] and wired["toSampler"] and wired["samplerLinked"], str(wired)
    assert wired["toEncoder"] is False and not wired["encoderLinked"], str(wired)


@pytest.mark.parametrize("saved_as", ["MODEL,CLIP,VAE", "COMFY_MATCHTYPE_V3"])
def test_a_saved_workflow_loads_with_its_links_and_a_typed_output(graph_page, tmp_path, saved_as):
    # Saved by this version (the three types) or by one that used ComfyUI's MatchType (its template type).
    workflow = json.loads(MOVE.read_text())
    move = next(n for n in workflow["nodes"] if n["type"] == "DeviceControl_MoveToGPU")
    move["outputs"][0]["type"] = saved_as
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(workflow))
    graph_page.load_workflow(saved)
    assert graph_page.page.evaluate(MOVED_OUTPUT) == {"type": "MODEL", "links": len(move["outputs"][0]["links"])}
    assert graph_page.our_errors() == []


#: How many links the loaded graph has.
LINKS = """() => { const links = window.app.graph.links; return links instanceof Map ? links.size
    : Object.values(links).filter(Boolean).length; }"""


def test_every_example_workflow_keeps_every_link(graph_page):
    # The outputs that follow their input are typed when a workflow loads: none of the examples' links may drop.
    for workflow in sorted((REPO / "workflows").glob("*.json")):
        graph_page.load_workflow(workflow)
        assert graph_page.page.evaluate(LINKS) == len(json.loads(workflow.read_text())["links"]), workflow.name
    assert graph_page.our_errors() == []


#: Set the device of the loader and of Move To GPU to one this machine lacks (a workflow from another machine).
ELSEWHERE = """() => {
    for (const node of window.app.graph._nodes) {
        for (const widget of node.widgets || []) {
            if (["device", "model_device"].includes(widget.name)) widget.value = "gpu:3";
        }
    }
}"""


def test_a_device_this_machine_lacks_is_a_warning_shown_when_queued(editor, artifacts, frontend_version):
    editor.load_workflow(MOVE)
    editor.page.evaluate(ELSEWHERE)
    editor.click_run()
    page = editor.page
    try:
        # The toast's look differs between frontends (PrimeVue's before 1.5x): found by its text.
        for title, name in (("Load Checkpoint With Device", "model_device"), ("Move To GPU", "device")):
            page.get_by_text(re.compile(rf"^{title} #\d+$")).first.wait_for(state="visible", timeout=30_000)
            said = f"{name}: device 'gpu:3' does not exist on this machine (devices here: "
            told = page.get_by_text(said).first
            told.wait_for(state="visible", timeout=5_000)
            assert told.inner_text().endswith("using auto (ComfyUI's choice) instead")
        page.screenshot(path=str(artifacts / f"device_warning_{frontend_version}.png"))
    finally:
        editor.server.post("/queue", {"clear": True})
        editor.server.post("/interrupt", {})
    assert editor.our_errors() == []


#: Set Move To GPU's budget to ``abc`` (a typo), as a user types it in the widget.
BAD_BUDGET = """() => {
    const move = window.app.graph._nodes.find((n) => n.comfyClass === "DeviceControl_MoveToGPU");
    move.widgets.find((w) => w.name === "vram_budget").value = "abc";
    return move.id;
}"""

#: The node errors the frontend keeps from the last queue attempt, where this frontend keeps them.
NODE_ERRORS = """() => window.app.lastNodeErrors ?? null"""


def test_a_bad_budget_is_one_error_on_the_budget_in_the_packs_words_and_nothing_runs(
    editor, artifacts, frontend_version
):
    editor.load_workflow(MOVE)
    node = editor.page.evaluate(BAD_BUDGET)
    history = len(editor.server.get("/history"))
    editor.click_run()
    page = editor.page
    try:
        page.get_by_text(re.compile(rf"^Move To GPU #{node}$")).first.wait_for(state="visible", timeout=30_000)
        told = page.get_by_text("vram_budget: VRAM budget: 'abc' is not a memory size; write it like").first
        told.wait_for(state="visible", timeout=5_000)
        page.screenshot(path=str(artifacts / f"bad_budget_{frontend_version}.png"))
        errors = page.evaluate(NODE_ERRORS)
        if errors is not None:  # the outline: one error, on the budget (frontends that keep them on the app)
            assert list(errors) == [str(node)], errors
            assert [e["extra_info"]["input_name"] for e in errors[str(node)]["errors"]] == ["vram_budget"], errors
    finally:
        editor.server.post("/queue", {"clear": True})
        editor.server.post("/interrupt", {})
    assert len(editor.server.get("/history")) == history  # nothing was queued, so nothing ran
    assert editor.our_errors() == []


#: The report text of each of our placing nodes that has one, by node id.
PLACING_TEXTS = """() => Object.fromEntries(window.app.graph.nodes
    .filter((n) => ["DeviceControl_LoadCheckpoint", "DeviceControl_MoveToGPU"].includes(n.comfyClass))
    .map((n) => [String(n.id), n.widgets.find((w) => w.name === "report_text").element.value]))"""


def test_a_cached_placing_node_says_where_its_model_is_now_and_its_badge_that_it_was_cached(
    editor, artifacts, frontend_version
):
    """The starter ran before (from another tab, or the API); queued unchanged in this fresh page, the loader and
    Move To GPU come from ComfyUI's cache: their texts say where their models are now, their badges that they did
    not run (they used to show "The node's report appears here when it runs" and no badge)."""
    editor.load_workflow(MOVE)
    page = editor.page
    prompt = json.loads(page.evaluate("async () => JSON.stringify((await window.app.graphToPrompt()).output)"))
    editor.server.run(prompt)
    page.evaluate(LISTEN_FOR_OWN_PROFILE)
    editor.click_run()
    page.wait_for_function("window.__dcProfile", timeout=120_000)
    texts = page.evaluate(PLACING_TEXTS)
    cached = "From ComfyUI's cache (this node did not run). Where its models are now:"
    assert set(texts) == {"1", "3"} and all(text.startswith(cached) for text in texts.values()), texts
    # Offload To CPU ran in the first run, after Move To GPU: the UNet is in RAM now, and the text says so.
    assert "SD15 diffusion model: 3.20 GiB on cpu" in texts["3"], texts["3"]
    badges = drawn_badges(page, 0.9, (20, 110))  # the loader and Move To GPU at a readable size
    assert badges["1"]["text"] == badges["3"]["text"] == "cached: did not run", badges
    page.screenshot(path=str(artifacts / f"cached_placing_nodes_{frontend_version}.png"))
    assert editor.our_errors() == []


#: Show a long line on Move To GPU and on a VRAM Report as a run would (their onExecuted), and measure each box.
LONG_LINE = """() => {
    const line = "device: device 'gpu:3' does not exist on this machine (devices here: cpu (CPU), gpu:0 (Simulated "
        + "GPU 0, 8.00 GiB)); using auto (ComfyUI's choice) instead";
    const measure = (type) => {
        const node = window.app.graph._nodes.find((n) => n.comfyClass === type);
        node.onExecuted({text: [line]});
        const area = node.widgets.find((w) => w.name === "report_text").element;
        return {overflows: area.scrollWidth > area.clientWidth + 1, wraps: getComputedStyle(area).whiteSpace};
    };
    return {move: measure("DeviceControl_MoveToGPU"), report: measure("DeviceControl_VRAMReport")};
}"""


def test_a_long_line_of_a_node_text_wraps_at_the_nodes_edge(editor):
    """A fallback warning on Move To GPU was cut at the node's edge; a VRAM Report's table keeps its columns."""
    editor.load_workflow(MOVE)
    shown = editor.page.evaluate(LONG_LINE)
    assert shown["move"] == {"overflows": False, "wraps": "pre-wrap"}, shown
    assert shown["report"]["wraps"] == "pre", shown
    assert editor.our_errors() == []
