"""The example workflows as the template browser opens them: every node of every one laid out apart from the others
(the frontend's own rectangles, after it sized each node) and reading left to right, the starter at a zoom where the
frontend draws node text, on the frontend ComfyUI pins and on 1.45.21 and the newest; each has its own thumbnail."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.browser.conftest import PINNED
from tests.passes import EVERY_VERSION
from tools.runtime.provision import DEFAULT_VERSION, NEWEST_FRONTEND, RELEASES
from tools.templates.workflow_api import load_workflow

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((REPO / "workflows").glob("*.json"))
STARTER = WORKFLOWS[0]
#: The pinned frontend, and 1.45.21 and the newest where the pinned one is neither.
FRONTENDS = [PINNED, *sorted({"1.45.21", NEWEST_FRONTEND} - {RELEASES[DEFAULT_VERSION].frontend})]

pytestmark = pytest.mark.parametrize("frontend_version", FRONTENDS, indirect=True, scope="module")

#: Each node's rectangle [x, y, width, height] as the frontend holds it, its title bar included, and the links
#: (each [id, from node, from slot, to node, to slot, type]).
RECTANGLES = """() => ({
    nodes: window.app.graph._nodes.map(n => {
        const r = n.boundingRect ? Array.from(n.boundingRect) : [n.pos[0], n.pos[1] - 30, n.size[0], n.size[1] + 30];
        return {id: n.id, title: n.title, rect: r};
    }),
    links: window.app.graph.serialize().links,
})"""

#: Open a template as the template browser does (the frontends from 1.45 fit it to the window, older ones take its
#: stored view; ours then opens a marked graph at its stored view where that fit draws no text), and read the view
#: a few frames later: the scale, the node text's size on screen against the frontend's threshold, and where the
#: first node (the loader) is on screen.
OPEN_AS_TEMPLATE = """async ([wf, name]) => {
    await window.app.loadGraphData(wf, true, true, name, {openSource: "template"});
    for (let i = 0; i < 4; i++) await new Promise((done) => requestAnimationFrame(done));
    const ds = window.app.canvas.ds;
    const least = window.app.extensionManager?.setting?.get?.("LiteGraph.Canvas.MinFontSizeForLOD") ?? 8;
    const first = window.app.graph._nodes.reduce((a, b) => (b.pos[0] + b.pos[1] < a.pos[0] + a.pos[1] ? b : a));
    return {scale: ds.scale, textPx: 14 * ds.scale * Math.sqrt(window.devicePixelRatio || 1), least,
            first: [(first.pos[0] + ds.offset[0]) * ds.scale, (first.pos[1] + ds.offset[1]) * ds.scale]};
}"""


def _overlaps(nodes: list[dict]) -> list[tuple[str, str]]:
    found = []
    for i, a in enumerate(nodes):
        ax, ay, aw, ah = a["rect"]
        for b in nodes[i + 1 :]:
            bx, by, bw, bh = b["rect"]
            if ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah:
                found.append((a["title"], b["title"]))
    return found


def _backwards(nodes: list[dict], links: list[list]) -> list[tuple[str, str]]:
    """The links that run from a node to one left of it in the same band (a node below the other's bottom starts a
    band of its own: the second checkpoint of ``07``)."""
    rect = {str(n["id"]): n["rect"] for n in nodes}  # ids are numbers on some frontends, strings on others
    title = {str(n["id"]): n["title"] for n in nodes}
    found = []
    for _id, source, _slot, target, *_ in links:
        source, target = str(source), str(target)
        (sx, sy, _sw, sh), (tx, ty, _tw, _th) = rect[source], rect[target]
        if tx < sx and ty < sy + sh:
            found.append((title[source], title[target]))
    return found


def test_no_two_nodes_of_a_template_overlap_and_each_reads_left_to_right(graph_page):
    """Each template loaded in turn, measured after the frontend sized its nodes. The starter's report "after
    Offload To CPU" sat left of KSampler, before it: the graph read backwards."""
    frontend = graph_page
    overlapping, backwards = {}, {}
    for workflow in WORKFLOWS:
        frontend.load_workflow(workflow)
        frontend.page.wait_for_timeout(100)
        shown = frontend.page.evaluate(RECTANGLES)
        if pairs := _overlaps(shown["nodes"]):
            overlapping[workflow.stem] = pairs
        if pairs := _backwards(shown["nodes"], shown["links"]):
            backwards[workflow.stem] = pairs
    assert WORKFLOWS and overlapping == {} and backwards == {}, (overlapping, backwards)


@EVERY_VERSION  # in ComfyUI 0.33.0's pass, on the frontend it pins (1.48.7), where a user saw it
def test_the_starter_opens_at_its_start_where_node_text_shows(graph_page):
    """It opened at 29 % on 1.48.7 (a fit of one row 4,200 px long), where the frontend draws boxes without text.
    Opened in a page that showed other graphs before, as a user opens it from the template browser."""
    view = graph_page.page.evaluate(OPEN_AS_TEMPLATE, [load_workflow(STARTER), STARTER.stem])
    assert view["textPx"] >= view["least"], view
    assert 0 <= view["first"][0] < 120 and 0 <= view["first"][1] < 160, view  # the loader, at the top left


#: What the template browser is given, through the frontend's own client: the list of each pack's templates, and
#: for ours whether each thumbnail is served as an image.
LISTED = """async () => {
    const listing = await window.app.api.getWorkflowTemplates();
    const [pack, names] = Object.entries(listing).find(([, found]) => found.some((n) => n.startsWith("01 ")));
    const images = [];
    for (const name of names) {
        const answer = await fetch(window.app.api.apiURL(`/workflow_templates/${pack}/${name}.jpg`));  // as the card
        images.push(answer.ok && answer.headers.get("content-type") === "image/jpeg");
    }
    return {names, images};
}"""


def test_the_template_browser_lists_ours_in_their_numbers_order_with_readable_titles(graph_page):
    """The browser's default sort keeps this order; the title it shows is the file name ("01 Start here - ...",
    not "01_start_here_sd15_..."), listed last on a Linux disk before the pack sorted it."""
    listed = graph_page.page.evaluate(LISTED)
    assert listed["names"] == sorted(workflow.stem for workflow in WORKFLOWS), listed["names"]
    assert listed["names"][0] == STARTER.stem and STARTER.stem.startswith("01 Start here - ")
    assert all("_" not in name for name in listed["names"]), listed["names"]  # words, not a file's snake case
    assert all(listed["images"]), listed


def test_every_template_has_a_small_thumbnail(frontend_version):
    """The template browser shows ``<name>.jpg`` beside each custom-node template: a card with its number, title
    and placing steps (``tools/templates/make_thumbnails.py``), not a shrunk graph, alike in every template."""
    if frontend_version != PINNED:
        pytest.skip("the files do not depend on the frontend")
    thumbnails = [workflow.with_suffix(".jpg") for workflow in WORKFLOWS]
    for thumbnail in thumbnails:
        assert thumbnail.exists(), f"{thumbnail.name} is missing: run tools/templates/make_thumbnails.py"
        assert thumbnail.stat().st_size < 60_000, thumbnail.name
    assert len({thumbnail.read_bytes() for thumbnail in thumbnails}) == len(thumbnails)  # each a card of its own
