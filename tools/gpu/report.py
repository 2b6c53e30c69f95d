"""The GPU benchmark's figures worked out and shown: the link floor of every run, and the markdown table.

The link floor of a step is ``max(compute, passes x streamed bytes / pinned host-to-device bandwidth)``: no
offloader can step faster than the device computes, nor faster than the bytes it does not keep resident cross the
link, once for each time the sampler runs the model in a step (ComfyUI runs the conditional and unconditional halves
of a batch apart when it finds too little memory free for both, so a small card can take two passes a step). Compute
is the fastest fully resident step of the case (ComfyUI's own or ours, on the whole card); the streamed bytes are the
diffusion model's bytes less those resident on the GPU after the run; the passes are counted during the run; the
bandwidth is the pinned copy measured first. ``step / floor`` is how far a run is from it (1.00x: at the floor).
"""

from __future__ import annotations

from typing import Any

GiB = 1024**3
MiB = 1024**2

COLUMNS = (
    "case",
    "run",
    "card",
    "ms per step",
    "resident on GPU",
    "streamed per pass",
    "passes a step",
    "link floor",
    "step / floor",
    "peak allocated",
    "image diff (0-255)",
)


def finish_case(result: dict[str, Any], pinned: float) -> dict[str, Any]:
    """Add the compute, and each run's streamed bytes, transfer time, floor and step over floor, to ``result``."""
    total = result.get("total_bytes", 0)
    timed = [row for row in result["rows"] if "step_ms" in row]
    resident = [row["step_ms"] for row in timed if row.get("card") == "whole card"]
    compute = min(resident) if resident else None
    result["compute_ms"] = compute
    result["pinned_bytes_per_s"] = pinned
    for row in timed:
        if row.get("device") == "cpu":  # ComfyUI on the CPU beside a simulated GPU: nothing crosses a link
            continue
        streamed = max(0, total - row.get("resident_bytes", 0))
        row["streamed_bytes"] = streamed
        passes = row.get("passes_per_step") or 1
        row["transfer_ms"] = passes * streamed / pinned * 1000 if pinned > 0 else None
        if compute is not None and row["transfer_ms"] is not None:
            row["floor_ms"] = max(compute, row["transfer_ms"])
            row["step_over_floor"] = row["step_ms"] / row["floor_ms"]
    return result


def _size(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / GiB:.2f} GiB" if abs(value) >= GiB else f"{value / MiB:.0f} MiB"


def _cell(row: dict[str, Any], key: str, show: Any) -> str:
    value = row.get(key)
    return "-" if value is None else show(value)


def row_cells(label: str, row: dict[str, Any]) -> list[str]:
    """One run's cells (a failed or skipped run says so in its step cell)."""
    if "step_ms" not in row:
        why = f"failed: {row['error']}" if "error" in row else row.get("skipped", "not run")
        return [label, row["run"], row.get("card", "-"), why.replace("|", "/")[:160], *["-"] * 7]
    resident = "CPU (no GPU)" if row.get("device") == "cpu" else _size(row.get("resident_bytes"))
    return [
        label,
        row["run"],
        row.get("card", "-"),
        f"{row['step_ms']:.1f}",
        resident,
        _cell(row, "streamed_bytes", _size),
        _cell(row, "passes_per_step", lambda v: f"{v:g}"),
        _cell(row, "floor_ms", lambda v: f"{v:.1f} ms"),
        _cell(row, "step_over_floor", lambda v: f"{v:.2f}x"),
        _cell(row, "peak_bytes", _size),
        _cell(row, "image_diff_255", str),
    ]


def heading(raw: dict[str, Any]) -> list[str]:
    """The lines above the table: where it ran, the link, what the columns mean."""
    machine = raw.get("machine", {})
    card = machine.get("card", {})
    speeds = raw.get("bandwidth", {})
    settings = raw.get("settings", {})
    link = ", ".join(f"{kind} {value / 1e9:.1f} GB/s" for kind, value in speeds.items()) or "not measured"
    lines = [
        f"GPU benchmark ({raw.get('mode', '?')}), {raw.get('created', '')}: {card.get('name', 'no card')}, "
        f"torch {card.get('torch', '?')}, Python {machine.get('python', '?')}, ComfyUI {machine.get('comfyui', '?')} "
        f"(its own offloading: {machine.get('comfyui_offloading', '?')}).",
        f"Host to device (1 GiB copies): {link}. Each run: {settings.get('warm_up', '?')} warm-up and "
        f"{settings.get('timed', '?')} timed steps (their mean), {' '.join(settings.get('sampler', ()))}, "
        f"cfg {settings.get('cfg', '?')}, one seed.",
        "Link floor: max(compute, passes a step x streamed / pinned bandwidth), compute the case's fastest fully "
        "resident step. "
        "Peak allocated: during the run, the block that makes the card small left out. Image diff: the decoded "
        "image's largest difference from ComfyUI's own fully resident run.",
    ]
    for key, case in raw.get("cases", {}).items():
        compute = case.get("compute_ms")
        lines.append(
            f"- {case.get('label', key)}: diffusion model {_size(case.get('total_bytes'))}, compute "
            f"{'-' if compute is None else f'{compute:.1f} ms'} a step."
        )
    made = [f"{key} ready after {entry['ready_after_s']} s" for key, entry in raw.get("fixtures", {}).items()]
    if made:
        lines.append(f"- Fixtures (made beside the runs, in a second process): {', '.join(made)}.")
    for key, error in raw.get("errors", {}).items():
        lines.append(f"- {key}: failed: {error}")
    return lines


def table(raw: dict[str, Any]) -> str:
    """The heading, then one table row per run of every case."""
    lines = [*heading(raw), "", "| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for key, case in raw.get("cases", {}).items():
        for row in case.get("rows", []):
            lines.append("| " + " | ".join(row_cells(case.get("label", key), row)) + " |")
    return "\n".join(lines)
