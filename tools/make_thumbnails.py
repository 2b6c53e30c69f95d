"""Write each example workflow's thumbnail (``workflows/<name>.jpg``): its graph as the real frontend draws it.

ComfyUI serves a custom-node pack's ``workflows/`` (or ``example_workflows/``) folder to the frontend's template
browser, which shows ``<name>.jpg`` beside each ``<name>.json`` (the title and the description are the file name).
This opens each workflow as it ships (the released file names) in headless Chromium, fits the graph to the canvas
and saves a small JPEG of the canvas alone.

Run ``python3 tools/make_thumbnails.py`` (with the runtime's Python) after ``tools/make_workflows.py``.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import logging
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from PIL import Image
from playwright.sync_api import sync_playwright

from tools.comfy_server import ComfyServer
from tools.runtime import CHROMIUM, REPO

log = logging.getLogger("device_control.tools")
THUMBNAIL = (512, 300)
VIEWPORT = {"width": 1600, "height": 1000}
FLAGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]

#: Fit the graph, widened to the thumbnail's shape, to the canvas's top left corner; return the canvas as a PNG
#: data URL and the drawn region's size (the canvas alone: no menus, buttons or minimap over it).
DRAW = """async ([aspect]) => {
    const nodes = window.app.graph._nodes;
    const left = Math.min(...nodes.map(n => n.pos[0])) - 40, top = Math.min(...nodes.map(n => n.pos[1] - 30)) - 40;
    let w = Math.max(...nodes.map(n => n.pos[0] + n.size[0])) - left + 40;
    let h = Math.max(...nodes.map(n => n.pos[1] + n.size[1])) - top + 40;
    if (w / h < aspect) w = h * aspect; else h = w / aspect;
    const canvas = window.app.canvas, ds = canvas.ds;
    ds.scale = Math.min(canvas.canvas.width / w, canvas.canvas.height / h);
    ds.offset[0] = -left;
    ds.offset[1] = -top;
    canvas.setDirty(true, true);
    canvas.draw(true, true);
    return [canvas.canvas.toDataURL("image/png"), w * ds.scale, h * ds.scale];
}"""


def shoot(page, workflow: Path) -> bytes:
    """The workflow's thumbnail as JPEG bytes."""
    page.evaluate("async (wf) => { await window.app.loadGraphData(wf); }", json.loads(workflow.read_text()))
    page.wait_for_timeout(300)
    url, width, height = page.evaluate(DRAW, [THUMBNAIL[0] / THUMBNAIL[1]])
    image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
    image = image.crop((0, 0, int(width), int(height))).resize(THUMBNAIL, Image.LANCZOS)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=82, optimize=True)
    return out.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as base:
        server = ComfyServer(Path(base), env={"DEVICE_CONTROL_SIMULATE_GPU": "8GiB"}).start()
        server.post("/settings/Comfy.TutorialCompleted", True)
        try:
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=FLAGS)
                page = browser.new_page(viewport=VIEWPORT)
                page.goto(server.url + "/")
                page.wait_for_function("window.app && window.app.graph && window.app.canvas", timeout=90_000)
                for workflow in sorted((REPO / "workflows").glob("*.json")):
                    path = workflow.with_suffix(".jpg")
                    path.write_bytes(shoot(page, workflow))
                    log.info("[Device Control] wrote %s (%d KB)", path.relative_to(REPO), path.stat().st_size // 1024)
                browser.close()
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
