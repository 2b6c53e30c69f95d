"""In the real editor, Move To GPU's model output takes the type of what is connected to its input (a CLIP in, a CLIP
out), so the editor refuses to wire a moved CLIP into a KSampler's model input. That needs a ComfyUI whose MatchType
works (0.28.0 among those tested; elsewhere the output stays ``MODEL,CLIP,VAE`` and this module is skipped), on the
frontend it pins and on the newest one served."""

from __future__ import annotations

from typing import Any

import pytest

from tests.browser.conftest import PINNED
from tests.integration.test_object_info import MATCH_TYPE_WORKS
from tools.runtime import DEFAULT_VERSION, NEWEST_FRONTEND

pytestmark = [
    pytest.mark.parametrize("frontend_version", [PINNED, NEWEST_FRONTEND], indirect=True, scope="module"),
    pytest.mark.skipif(
        DEFAULT_VERSION not in MATCH_TYPE_WORKS,
        reason=f"ComfyUI {DEFAULT_VERSION}'s MatchType does not work: Move To GPU's output stays MODEL,CLIP,VAE",
    ),
]

#: Builds a graph through the frontend's own graph API: a loader's output into Move To GPU, then Move To GPU's
#: output offered to a KSampler's model input and to a CLIP Text Encode's clip input. Returns what the editor did.
WIRE = """async ([loaderType, outputName, linkFirst]) => {
    const graph = window.app.graph;
    graph.clear();
    const add = (type) => { const node = window.LiteGraph.createNode(type); graph.add(node); return node; };
    const loader = add(loaderType), move = add("DeviceControl_MoveToGPU");
    const sampler = add("KSampler"), encode = add("CLIPTextEncode");
    const frame = () => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)));
    await frame();
    const modelIn = sampler.findInputSlot("model"), clipIn = encode.findInputSlot("clip");
    const typeBefore = move.outputs[0].type;
    // Wired before the input is connected (the output takes any type then): connecting a CLIP must drop it.
    const early = linkFirst ? !!move.connect(0, sampler, modelIn) : null;
    const fed = !!loader.connect(loader.findOutputSlot(outputName), move, move.findInputSlot("model"));
    await frame();
    const typeAfter = move.outputs[0].type;
    const keptEarly = linkFirst ? sampler.inputs[modelIn].link != null : null;
    if (sampler.inputs[modelIn].link != null) sampler.disconnectInput(modelIn);
    const toSampler = !!move.connect(0, sampler, modelIn);
    const toEncoder = !!move.connect(0, encode, clipIn);
    const valid = window.LiteGraph.isValidConnection(typeAfter, sampler.inputs[modelIn].type);
    return {typeBefore, early, fed, typeAfter, keptEarly, toSampler, toEncoder, valid,
            samplerLinked: sampler.inputs[modelIn].link != null, encoderLinked: encode.inputs[clipIn].link != null};
}"""


def _wire(frontend: Any, loader: str, output: str, link_first: bool = False) -> dict[str, Any]:
    return frontend.page.evaluate(WIRE, [loader, output, link_first])


@pytest.fixture
def editor(frontend):
    """The editor, opened on a server that gives Move To GPU's model input a match-type template."""
    frontend.open()
    return frontend


def test_a_moved_clip_is_a_clip_and_cannot_feed_a_sampler(editor):
    wired = _wire(editor, "CLIPLoader", "CLIP")
    assert wired["fed"] and wired["typeAfter"] == "CLIP", wired
    assert wired["valid"] is False and wired["toSampler"] is False and not wired["samplerLinked"], wired
    assert wired["toEncoder"] and wired["encoderLinked"], wired
    assert editor.our_errors() == []


def test_a_link_to_a_sampler_made_before_a_clip_is_connected_is_dropped(editor):
    wired = _wire(editor, "CLIPLoader", "CLIP", link_first=True)
    assert wired["early"] is True, wired  # nothing connected yet: the output takes any type
    assert wired["typeAfter"] == "CLIP" and wired["keptEarly"] is False, wired


def test_a_moved_model_still_feeds_a_sampler(editor):
    wired = _wire(editor, "CheckpointLoaderSimple", "MODEL")
    assert wired["fed"] and wired["typeAfter"] == "MODEL", wired
    assert wired["valid"] and wired["toSampler"] and wired["samplerLinked"], wired
    assert wired["toEncoder"] is False and not wired["encoderLinked"], wired
