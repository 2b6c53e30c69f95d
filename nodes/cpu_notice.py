"""When ComfyUI computes on the CPU, a prompt that will take many minutes says so when it is queued, and what to lower.

Without a GPU (ComfyUI started with ``--cpu``, or none found) the starter's 512x512 and 20 steps took 14 minutes
on a 2-core machine (``docs/bench/cpu_step.md``: 42 s a step, with ComfyUI's loader or ours), and nothing on the
canvas said so. So when such a prompt is queued, the editor shows a notice naming the node that sets the image
size: what a step takes there, and what to lower for a first look. Said once per frontend (client id) and size.
"""

from __future__ import annotations

from typing import Any

from . import surface
from .device_warnings import warn

#: One SD1.5 step at 512x512 (cfg 7) on the CPU of a 2-core machine, in seconds (``docs/bench/cpu_step.md``).
STEP_SECONDS_512 = 42
#: A latent of this many pixels or more is worth the notice (a 64x64 test image is not).
NOTICED_PIXELS = 384 * 384

_told: set[tuple[Any, int, int]] = set()


def _computes_on_cpu() -> bool:
    device = surface.model_management().get_torch_device()
    return getattr(device, "type", str(device)) == "cpu"


def _sizes(prompt: dict[str, Any]) -> list[tuple[str, str, int, int]]:
    """The image sizes a prompt sets: (node id, title, width, height) for each node with a literal width and height
    (Empty Latent Image and its kind)."""
    found = []
    for node_id, entry in prompt.items():
        inputs = entry.get("inputs") if isinstance(entry, dict) else None
        width, height = (inputs or {}).get("width"), (inputs or {}).get("height")
        if isinstance(width, int) and isinstance(height, int):
            meta = entry.get("_meta") if isinstance(entry.get("_meta"), dict) else {}
            found.append((str(node_id), str(meta.get("title") or entry.get("class_type")), width, height))
    return found


def _steps(prompt: dict[str, Any]) -> int | None:
    """The most steps a sampler of the prompt takes, where one is given as a number."""
    steps = [
        entry["inputs"]["steps"]
        for entry in prompt.values()
        if isinstance(entry, dict) and isinstance((entry.get("inputs") or {}).get("steps"), int)
    ]
    return max(steps, default=None)


def notice(width: int, height: int, steps: int | None) -> str:
    """What the notice says for an image of ``width`` x ``height`` sampled in ``steps``."""
    step = STEP_SECONDS_512 * width * height / (512 * 512)
    total = f"; {steps} steps: about {max(1, round(step * steps / 60))} minutes" if steps else ""
    return (
        f"ComfyUI computes on the CPU here (started with --cpu, or no GPU found), so this runs slowly: at "
        f"{width}x{height} an SD1.5 step takes about {round(step)} s on a 2-core machine{total} (more for larger "
        "models, less with more cores). For a first look, set the size to 256x256 and the steps to 4."
    )


def tell(body: dict[str, Any]) -> None:
    """Queue time: show the notice for the prompt in ``body`` where ComfyUI computes on the CPU."""
    prompt = body.get("prompt")
    if not isinstance(prompt, dict) or not _computes_on_cpu():
        return
    steps = _steps(prompt)
    for node_id, title, width, height in _sizes(prompt):
        told = (body.get("client_id"), width, height)
        if width * height < NOTICED_PIXELS or told in _told:
            continue
        _told.add(told)
        warn(title, node_id, notice(width, height, steps))
