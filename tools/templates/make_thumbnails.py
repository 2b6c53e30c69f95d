"""Write each example workflow's thumbnail (``workflows/<name>.jpg``): a card that says what the template does.

ComfyUI serves a custom-node pack's ``workflows/`` (or ``example_workflows/``) folder to the frontend's template
browser, which shows ``<name>.jpg`` beside each ``<name>.json`` (the title and the description are the file name).
A picture of the graph shrunk to a thumbnail is a dozen grey boxes, alike in every template; a card is read at a
glance: the template's number and title, the model family in its own colour, and the steps that place the models,
in the graph's order (read from the file: which loader puts which part where, Move To GPU's device and budget,
Offload To CPU, a split), drawn in headless Chromium and saved as a small JPEG.

Run ``python3 tools/templates/make_thumbnails.py`` (with the runtime's Python) after
``tools/templates/make_workflows.py``.
"""

from __future__ import annotations

import argparse
import html
import io
import json
import logging
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from PIL import Image
from playwright.sync_api import sync_playwright

from tools.runtime.provision import CHROMIUM, REPO

log = logging.getLogger("device_control.tools")
THUMBNAIL = (512, 300)
FLAGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
#: A family's colour, by the word its title names it with (the first that matches).
COLOURS = (("SDXL", "#8e5cd9"), ("SD3.5", "#3f9d6b"), ("Flux", "#d9822b"), ("Chroma", "#c2477f"),
           ("Wan", "#2b9bb0"), ("", "#3a78c9"))  # fmt: skip


def where(device: str) -> str:
    """A device as the card names it."""
    return {"cpu": "RAM", "auto": "ComfyUI's choice"}.get(device, device)


def steps(workflow: dict[str, Any]) -> list[str]:
    """The steps that place the workflow's models, in the order the graph runs them."""
    said = []
    for node in sorted(workflow["nodes"], key=lambda n: n.get("order", 0)):
        kind, values = node["type"], node.get("widgets_values") or []
        if kind == "DeviceControl_LoadCheckpoint":
            unet, clip, vae = (where(d) for d in values[1:4])
            said.append(f"Load: UNet to {unet}, CLIP to {clip}, VAE to {vae}")
        elif kind == "DeviceControl_LoadDiffusionModel":
            said.append(f"Diffusion model to {where(values[1])}" + (f", {values[2]}" if values[2] != "auto" else ""))
        elif kind == "DeviceControl_LoadTextEncoders":
            said.append(f"Text encoders to {where(values[-2])}")
        elif kind == "DeviceControl_LoadVAE":
            said.append(f"VAE to {where(values[1])}")
        elif kind == "DeviceControl_MoveToGPU":
            said.append(f"Move To GPU: {values[0]}" + (f", {values[1]} budget" if values[1] != "all" else ", all"))
        elif kind == "DeviceControl_OffloadToCPU":
            said.append("Offload To CPU")
        elif kind == "DeviceControl_UpscaleImage":
            said.append(f"Upscale on {where(values[0])}")
        elif kind == "DeviceControl_SplitModel":
            said.append(f"Split: {values[0]}")
        elif kind == "UNETLoader":
            said.append("ComfyUI's Load Diffusion Model")
        elif kind == "CheckpointLoaderSimple":
            said.append("ComfyUI's Load Checkpoint")
        elif kind == "LoraLoader":
            said.append("LoRA")
        elif kind in ("KSampler", "KSamplerAdvanced"):
            said.append("Sample")
        elif kind == "VAEDecode":
            said.append("Decode")
    return said


def card(name: str, workflow: dict[str, Any]) -> str:
    """The card's page."""
    number, _, title = name.partition(" ")
    colour = next(colour for word, colour in COLOURS if word in title)
    reports = sum(node["type"] == "DeviceControl_VRAMReport" for node in workflow["nodes"])
    chips = "".join(f"<span>{html.escape(step)}</span>" for step in steps(workflow))
    if reports:
        chips += f'<span class="report">{reports} VRAM Report{"s" if reports > 1 else ""}</span>'
    return f"""<html><body style="margin:0"><div style="width:{THUMBNAIL[0]}px;height:{THUMBNAIL[1]}px;
        box-sizing:border-box;padding:18px 22px;background:#1e1f22;border-top:10px solid {colour};
        font-family:sans-serif;color:#e8e8e8">
      <div style="display:flex;align-items:baseline;gap:14px">
        <b style="font-size:54px;color:{colour}">{html.escape(number)}</b>
        <b style="font-size:23px;line-height:1.15">{html.escape(title)}</b></div>
      <div style="margin-top:14px;display:flex;flex-wrap:wrap;gap:7px;font-size:15px">{chips}</div>
      <style>span{{background:#34363b;border-radius:5px;padding:4px 8px}} span.report{{background:#2f4a3a}}</style>
    </div></body></html>"""


def shoot(page: Any, workflow: Path) -> bytes:
    """The workflow's thumbnail as JPEG bytes."""
    page.set_content(card(workflow.stem, json.loads(workflow.read_text())))
    image = Image.open(
        io.BytesIO(page.screenshot(clip={"x": 0, "y": 0, "width": THUMBNAIL[0], "height": THUMBNAIL[1]}))
    )
    out = io.BytesIO()
    image.convert("RGB").save(out, "JPEG", quality=85, optimize=True)
    return out.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": THUMBNAIL[0], "height": THUMBNAIL[1]})
        for workflow in sorted((REPO / "workflows").glob("*.json")):
            path = workflow.with_suffix(".jpg")
            path.write_bytes(shoot(page, workflow))
            log.info("[Device Control] wrote %s (%d KB)", path.relative_to(REPO), path.stat().st_size // 1024)
        browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
