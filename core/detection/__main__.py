"""``python -m core.detection FILE``: what a model file is, read from its header, and whether it fits here.

An entry point, not a library module: it joins detection with the fit plan (``core.placement``) and the
device inventory (``core.devices``), which the detection package itself never imports.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..devices.backends import simulated_backends, simulated_devices_from_env
from ..devices.inventory import DeviceInventory
from ..errors import DeviceControlError
from ..placement.fit import DEFAULT_HEADROOM, Choice, FitPlan, default_dtype, plan_fit
from ..units import parse_size
from .components import CANDIDATE_DTYPES
from .detect import Detection, detect
from .report import render_text, to_dict

ROLES = ("diffusion_model", "text_encoder", "vae")


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
        inventory = DeviceInventory(extra=simulated_backends(simulated_devices_from_env()))
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


if __name__ == "__main__":
    sys.exit(main())
