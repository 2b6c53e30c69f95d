"""The detection report, as text for people and JSON for scripts, and the ``python -m core.detection`` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from typing import Any

from .components import CANDIDATE_DTYPES
from .detection import Detection, detect
from .devices import DeviceInventory, simulated_devices_from_env
from .errors import DeviceControlError
from .fit import DEFAULT_HEADROOM, Choice, FitPlan, default_dtype, plan_fit
from .units import format_bytes, parse_size

log = logging.getLogger("device_control")
ROLES = ("diffusion_model", "text_encoder", "vae")


def to_dict(detection: Detection, plan: FitPlan | None = None) -> dict[str, Any]:
    """The detection (and fit plan) as a JSON-ready dictionary."""
    data = asdict(detection)
    data["components"] = [asdict(c) for c in detection.components]
    data["lora"] = (
        None if detection.lora is None else {**asdict(detection.lora), "comfyui_loads": detection.lora.comfyui_loads}
    )
    data["fit"] = plan.to_dict() if plan is not None else None
    return data


def render_text(detection: Detection, plan: FitPlan | None = None) -> str:
    """The detection (and fit plan) for people."""
    lines = [f"File: {detection.path} ({detection.file_format}, read in {detection.seconds * 1000:.1f} ms)"]
    if detection.kind == "unknown":
        lines.append(f"Unknown model: {detection.reason}.")
        lines += [f"  closest: {candidate}" for candidate in detection.candidates]
        return "\n".join(lines)
    lines.append(f"Kind: {detection.kind.replace('_', ' ')}; family: {detection.family}")
    if detection.comfy_class:
        lines.append(f"ComfyUI class: {detection.comfy_class}; prediction: {detection.model_type}")
    if detection.variants:
        lines.append(f"Variant: {', '.join(detection.variants)}")
    if detection.lora is not None:
        lora = detection.lora
        lines.append(
            f"LoRA: {', '.join(lora.algorithms)}, rank {lora.rank}, {lora.layers} layers ({', '.join(lora.targets)}); "
            f"naming: {', '.join(lora.naming)}; ComfyUI loads it: {lora.comfyui_loads}"
        )
    lines.append("Components:")
    for c in detection.components:
        sizes = ", ".join(f"{dtype} {format_bytes(size)}" for dtype, size in c.bytes_by_dtype.items())
        lines.append(
            f"  {c.name:<24} {c.kind}: {c.tensor_count} tensors, {c.parameter_count / 1e6:,.1f} M parameters, "
            f"stored {'/'.join(c.stored_dtypes)} {format_bytes(c.stored_bytes)}; as {sizes}"
        )
    if plan is not None:
        lines.append("Fit:")
        lines += [f"  {p.component} -> {p.device} as {p.dtype}: {format_bytes(p.bytes)}" for p in plan.components]
        lines += [f"  {d.device}: {d.verdict}" for d in plan.devices]
    return "\n".join(lines)


def default_plan(
    detection: Detection,
    inventory: DeviceInventory,
    overrides: dict[str, str] | None = None,
    headroom: int = DEFAULT_HEADROOM,
) -> FitPlan:
    """A fit plan with every role on ``auto`` in its stored dtype, unless ``overrides`` says otherwise.

    ``overrides`` maps a role to ``DEVICE`` or ``DEVICE:DTYPE`` (``{"text_encoder": "cpu:fp16"}``).
    """
    snapshot = inventory.snapshot()
    choices = {}
    for role in ROLES:
        parts = detection.component(role)
        if not parts:
            continue
        device, dtype = split_placement((overrides or {}).get(role, "auto"))
        resolved = inventory.resolve(device, snapshot=snapshot).device
        choices[role] = Choice(resolved, dtype or default_dtype(parts[0]))
    return plan_fit(detection.components, choices, headroom=headroom)


def split_placement(spec: str) -> tuple[str, str]:
    """``"gpu:0:fp16"`` -> ``("gpu:0", "fp16")``; ``"cpu"`` -> ``("cpu", "")``."""
    device, _, last = spec.rpartition(":")
    return (device, last) if device and last in CANDIDATE_DTYPES else (spec, "")


def main(argv: list[str] | None = None) -> int:
    """``python -m core.detection FILE [--json] [--device ROLE=DEVICE[:DTYPE]] [--headroom SIZE]``."""
    parser = argparse.ArgumentParser(
        prog="python -m core.detection", description="What a model file is, and whether it fits."
    )
    parser.add_argument("file")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument(
        "--device",
        action="append",
        default=[],
        metavar="ROLE=DEVICE[:DTYPE]",
        help=f"place a role ({', '.join(ROLES)}) for the fit plan, e.g. text_encoder=cpu:fp16",
    )
    parser.add_argument("--headroom", default=str(DEFAULT_HEADROOM), help="memory kept free on GPUs (default 512MiB)")
    args = parser.parse_args(argv)
    try:
        overrides = dict(item.split("=", 1) for item in args.device)
        unknown = set(overrides) - set(ROLES)
        if unknown:
            raise DeviceControlError(f"unknown role(s) {sorted(unknown)}; use {', '.join(ROLES)}.")
        detection = detect(args.file)
        inventory = DeviceInventory(simulated=simulated_devices_from_env())
        plan = (
            None
            if detection.kind in ("unknown", "lora")
            else default_plan(detection, inventory, overrides, parse_size(args.headroom))
        )
    except (DeviceControlError, ValueError) as exc:
        sys.stderr.write(f"[Device Control] {exc}\n")
        return 2
    sys.stdout.write(
        (json.dumps(to_dict(detection, plan), indent=2) if args.json else render_text(detection, plan)) + "\n"
    )
    return 0 if detection.kind != "unknown" else 1
