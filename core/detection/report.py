"""A detection (and, when one is given, a fit plan) as text for people and as JSON for scripts."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from ..units import format_bytes
from .detect import Detection

if TYPE_CHECKING:  # the plan is made by core.placement, a package above this one; only its shape is used here
    from ..placement.fit import FitPlan


def to_dict(detection: Detection, plan: FitPlan | None = None) -> dict[str, Any]:
    """The detection (and fit plan) as a JSON-ready dictionary."""
    data = asdict(detection)
    data["components"] = [asdict(c) for c in detection.components]
    data["lora"] = None if detection.lora is None else asdict(detection.lora)
    data["fit"] = plan.to_dict() if plan is not None else None
    return data


def render_text(detection: Detection, plan: FitPlan | None = None) -> str:
    """The detection (and fit plan) for people."""
    lines = [f"File: {detection.path} ({detection.file_format}, read in {detection.seconds * 1000:.1f} ms)"]
    if detection.kind == "unknown":
        lines.append(f"Unknown model: {detection.reason}.")
        lines += [f"  closest: {candidate}" for candidate in detection.candidates]
        return "\n".join(lines)
    lines += _identity_lines(detection)
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


def _identity_lines(detection: Detection) -> list[str]:
    """Kind and family, ComfyUI's class, variants and, for a LoRA, what it is."""
    lines = [f"Kind: {detection.kind.replace('_', ' ')}; family: {detection.family}"]
    if detection.comfy_class:
        lines.append(f"ComfyUI class: {detection.comfy_class}; prediction: {detection.model_type}")
    if detection.variants:
        lines.append(f"Variant: {', '.join(detection.variants)}")
    lora = detection.lora
    if lora is not None:
        lines.append(
            f"LoRA: {', '.join(lora.algorithms)}, rank {lora.rank}, {lora.layers} layers ({', '.join(lora.targets)}); "
            f"naming: {', '.join(lora.naming)}; made for: {lora.target_family or 'unknown'} (which layers a model "
            "takes, Device Control says when the LoRA is applied to it)"
        )
    return lines
