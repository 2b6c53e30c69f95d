"""The example workflows as the template browser opens them: every node of every one laid out apart from the others
(the frontend's own rectangles, after it sized each node), on the frontend ComfyUI pins and on 1.45.21 and the newest;
each has its thumbnail beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.browser.conftest import PINNED
from tools.runtime import DEFAULT_VERSION, NEWEST_FRONTEND, RELEASES

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((REPO / "workflows").glob("*.json"))
#: The pinned frontend, and 1.45.21 and the newest where the pinned one is neither.
FRONTENDS = [PINNED, *sorted({"1.45.21", NEWEST_FRONTEND} - {RELEASES[DEFAULT_VERSION].frontend})]

pytestmark = pytest.mark.parametrize("frontend_version", FRONTENDS, indirect=True, scope="module")

#: Each node's rectangle [x, y, width, height] as the frontend holds it, its title bar included.
RECTANGLES = """() => window.app.graph._nodes.map(n => {
    const r = n.boundingRect ? Array.from(n.boundingRect) : [n.pos[0], n.pos[1] - 30, n.size[0], n.size[1] + 30];
    return {id: n.id, title: n.title, rect: r};
})"""


def _overlaps(nodes: list[dict]) -> list[tuple[str, str]]:
    found = []
    for i, a in enumerate(nodes):
        ax, ay, aw, ah = a["rect"]
        for b in nodes[i + 1 :]:
            bx, by, bw, bh = b["rect"]
            if ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah:
                found.append((a["title"], b["title"]))
    return found


def test_no_two_nodes_of_a_template_overlap(frontend):
    """One page load per frontend; each template loaded in turn, measured after the frontend sized its nodes."""
    frontend.open()
    overlapping = {}
    for workflow in WORKFLOWS:
        frontend.load_workflow(workflow)
        frontend.page.wait_for_timeout(100)
        pairs = _overlaps(frontend.page.evaluate(RECTANGLES))
        if pairs:
            overlapping[workflow.stem] = pairs
    assert WORKFLOWS and overlapping == {}


def test_every_template_has_a_small_thumbnail(frontend_version):
    """The template browser shows ``<name>.jpg`` beside each custom-node template."""
    if frontend_version != PINNED:
        pytest.skip("the files do not depend on the frontend")
    for workflow in WORKFLOWS:
        thumbnail = workflow.with_suffix(".jpg")
        assert thumbnail.exists(), f"{thumbnail.name} is missing: run tools/make_thumbnails.py"
        assert thumbnail.stat().st_size < 60_000, thumbnail.name
