"""What the loader nodes share in placing a file: a device and dtype choice turned into a placement, the fit plan,
the RAM check before anything is read, and the progress bar (which files a loader lists and takes:
``nodes.model_files``).

A device the machine lacks falls back to ComfyUI's default, with a note in the node's output, so shared workflows
still run.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from ..core.detection.detect import Detection
from ..core.devices.backends import DeviceInfo, backend_of
from ..core.devices.inventory import InventorySnapshot, parse_device_spec
from ..core.errors import DeviceControlError, InvalidDeviceSpecError
from ..core.placement.budget import Placement
from ..core.placement.fit import Choice, FitPlan, plan_fit
from ..core.units import format_bytes
from . import panel, surface
from .bridge import device_id
from .bridge.checkpoint import default_dtype
from .bridge.fallback import resolve_or_fallback
from .bridge.filling import ComponentPlan
from .cached_texts import remember
from .device_warnings import warn_missing_devices
from .state import device_options, device_tooltip, inventory

log = logging.getLogger("device_control")

#: Storage dtypes a loader offers, by the name the node shows.
DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
#: Storage dtypes a VAE can have (ComfyUI's VAE has no cast path for fp8).
VAE_DTYPES = ("auto", "fp32", "fp16", "bf16")
_CANDIDATE = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e5m2: "fp8",
}


def _comfy_default_device(role: str) -> torch.device:
    mm = surface.model_management()
    return {"diffusion_model": mm.get_torch_device, "text_encoder": mm.text_encoder_device, "vae": mm.vae_device}[
        role
    ]()


def _chosen_device(
    role: str, spec: str, snapshot: InventorySnapshot, notes: list[str]
) -> tuple[DeviceInfo, torch.device, bool]:
    """The device for ``role``, its torch device, and whether the user chose it (``auto`` and a device this
    machine lacks leave the choice to ComfyUI; the latter says so in ``notes``, as Move To GPU does)."""
    if spec.strip().lower() != "auto":
        info, warning = resolve_or_fallback(inventory, spec, snapshot)
        if info is not None:
            return info, torch.device(info.torch_device or "cpu"), True
        notes.append(f"{role.replace('_', ' ')}: {warning}")  # a workflow from another machine: run anyway
    torch_device = _comfy_default_device(role)
    return snapshot.get(device_id(torch_device, snapshot)) or snapshot.get("cpu"), torch_device, False


def _storage_dtype(role: str, name: str) -> torch.dtype | None:
    if role == "vae" and name not in VAE_DTYPES:
        raise DeviceControlError(vae_dtype_problem(name, "vae_dtype"))
    return DTYPES[name]


def vae_dtype_problem(name: str, option: str) -> str:
    """What is wrong with ``name`` as a VAE's storage dtype (given in the node's input ``option``)."""
    return (
        f"the VAE cannot be stored in {name}: ComfyUI's VAE has no cast path for it; choose "
        f"{', '.join(VAE_DTYPES[1:])} or auto for {option}."
    )


def device_input(name: str, what: str) -> Any:
    """A node's device choice for ``what``: ``auto``, ``cpu`` and every accelerator of this machine."""
    return surface.io.Combo.Input(
        name,
        options=device_options(),
        default="auto",
        tooltip=device_tooltip(
            f"Where the {what} lives: auto (ComfyUI's choice), cpu, or gpu:N. A device this machine does not "
            "have falls back to auto with a warning, so workflows from other machines still run."
        ),
    )


def dtype_input(name: str, what: str, options: list[str] | tuple[str, ...] = tuple(DTYPES)) -> Any:
    """A node's storage dtype choice for ``what``."""
    return surface.io.Combo.Input(
        name,
        options=list(options),
        default="auto",
        tooltip=(
            f"Storage dtype of the {what}: auto (ComfyUI's choice for the device), "
            f"{', '.join(o for o in options if o != 'auto')}. When the device cannot compute in it, weights are "
            "cast on the fly to a dtype it can."
        ),
    )


def check_devices(title: str, node: type, **inputs: str | None) -> bool | str:
    """A node's ``validate_inputs`` answer for its device inputs (by name), when the prompt is queued: a malformed
    one is refused; one this machine lacks is not an error (it falls back at run time) but a warning the user sees
    now (``device_warnings``), from node ``node`` (the class ComfyUI validates, shown as ``title``). A linked
    device (None) is checked when the node runs."""
    given = {name: value for name, value in inputs.items() if value is not None}
    for name, value in given.items():
        try:
            parse_device_spec(value)
        except InvalidDeviceSpecError as exc:
            return f"{name}: {exc}"
    hidden = getattr(node, "hidden", None)
    warn_missing_devices(title, getattr(hidden, "unique_id", None), **given)
    return True


def plan_load(
    name: str, components: Any, choices: dict[str, Choice], notes: list[str], node: type | None = None
) -> FitPlan:
    """The fit plan of a load, refused (before anything is read) when RAM cannot hold it; ``notes`` are logged, and
    the plan is shown on the loader ``node`` (the node class ComfyUI runs) before its weights are read."""
    plan = plan_fit(components, choices)
    require_ram(name, plan)
    for note in notes:
        log.warning("[Device Control] %s: %s", name, note)
    lines = [f"Loading {name}: the fit plan, before any weight is read"]
    lines += [
        f"  {c.component.replace('_', ' ')}: {c.device}, {c.dtype}: {format_bytes(c.bytes)}" for c in plan.components
    ]
    lines += [f"  fit on {d.device}: {d.verdict}" for d in plan.devices]
    lines += [f"  warning: {note}" for note in notes]
    log.info("[Device Control] %s", "\n".join(lines))
    _show_on_node(node, "\n".join(lines))
    return plan


def _show_on_node(node: type | None, text: str) -> None:
    """Show ``text`` on the running node in the frontend, where ComfyUI can (its progress text)."""
    hidden = getattr(node, "hidden", None)
    node_id = getattr(hidden, "unique_id", None)
    if node_id is None or not surface.running_in_comfyui():
        return
    send = getattr(surface.prompt_server(), "send_progress_text", None)
    if callable(send):
        send(text, node_id)


def loaded(node: type, summary: str, *values: Any) -> Any:
    """The output of loader ``node`` (the class ComfyUI runs): ``values`` and its summary, on the canvas too; the
    panel is told at once, and the node remembers what it gave out (its text when it comes from the cache)."""
    panel.announce()
    remember(node, values)
    log.info("[Device Control] %s", summary)
    return surface.io.NodeOutput(*values, summary, ui={"text": (summary,)})


def summary_output() -> Any:
    """The ``summary`` output every loader of ours has."""
    return surface.io.String.Output(
        display_name="summary", tooltip="What was loaded where, in which dtype, and whether it fits."
    )


def resolve_placement(
    role: str, spec: str, dtype_name: str, detection: Detection, snapshot: InventorySnapshot, notes: list[str]
) -> tuple[ComponentPlan, Choice]:
    """Turn a node's device and dtype choice for one role into a placement and a fit-plan choice."""
    info, torch_device, chosen = _chosen_device(role, spec, snapshot, notes)
    dtype = _storage_dtype(role, dtype_name)
    target = inventory.target(info.id, snapshot) if chosen and info.id else torch_device
    compute = backend_of(target).comfy_device(target)  # the host, for a device ComfyUI does not know
    # The user chose this device: the placement goes with the model. (auto: ComfyUI decides, as its loader does.)
    managed = Placement(target, device_id=info.id) if chosen and info.id else None
    place = ComponentPlan(compute, target, dtype, placement=managed)
    return place, Choice(info, _CANDIDATE[dtype or default_dtype(role, compute, detection)])


def with_fit(place: ComponentPlan, plan: FitPlan, choice: Choice) -> ComponentPlan:
    """``place``, knowing whether its device holds what the fit plan put there."""
    fits = {d.device: d.fits for d in plan.devices}
    return dataclasses.replace(place, fits=fits.get(choice.device.id, True))


def require_ram(name: str, plan: FitPlan) -> None:
    """Refuse, before anything is read, a load whose host share cannot fit in RAM."""
    host = next((d for d in plan.devices if d.device == "cpu"), None)
    if host is not None and not host.fits:
        raise DeviceControlError(
            f"{name} {host.verdict}. Nothing was read. Choose a smaller dtype (fp16 or fp8) for the "
            "largest component, put it on a GPU, or close programs that use RAM."
        )


def progress_bar() -> Any:
    """A progress callback that moves ComfyUI's bar and lets Cancel stop the load between two tensors."""
    mm = surface.model_management()
    bar = surface.comfy_utils().ProgressBar(1000)

    def report(done: int, total: int) -> None:
        mm.throw_exception_if_processing_interrupted()
        bar.update_absolute(int(1000 * done / max(total, 1)), 1000)

    return report
