"""The Split Model Across Devices node's work: a clone of the MODEL that carries a split, put in place now.

As with Move To GPU, the load is ComfyUI's own ``load_models_gpu`` (its list and sizes stay true), and the
result is read back from the weights: a split that is not in force afterwards is an error, never a success.
Everything that can be refused is refused before a weight moves: the allocation's text, its devices, a total
smaller than the model, a part larger than its device.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import torch

from ...core.devices.backends import backend_of
from ...core.devices.inventory import DeviceInventory, DeviceSpec, InventorySnapshot, parse_device_spec
from ...core.devices.tensors import HOST, same_target
from ...core.errors import DeviceControlError, DeviceNotFoundError, InvalidAllocationError
from ...core.placement.allocation import Allocation, Entry, parse_allocation
from ...core.placement.pipeline import hop_beside
from ...core.placement.split import Split, auto_allocation
from ...core.placement.split_model import MODES, plan_split, split_of
from ...core.units import format_bytes
from .. import surface
from .foreign import placeable
from .moves import MoveResult, clone_subject, state_before
from .splits import SplitPlacement, request_of, split_in_force
from .subjects import Subject, require_subject

log = logging.getLogger("device_control")


def split_model(value: Any, allocation: str, mode: str, inventory: DeviceInventory) -> MoveResult:
    """Share ``value``'s diffusion model (a MODEL) or text encoders (a CLIP) out over the devices of
    ``allocation``, in ``mode``, now.

    Raises:
        InvalidAllocationError: malformed, a device named twice, totals or a part that cannot hold the model.
        DeviceControlError: a VAE, a device out of memory, or a load that did not go through Device
            Control.
    """
    subject = require_subject(value)
    kind_check(subject)
    snapshot = inventory.snapshot()
    placement, warnings = resolve_allocation(allocation, mode, inventory, snapshot)
    subject = placeable(subject)  # a model another pack keeps quantised: our copy of it (once the input is valid)
    before = state_before(subject, snapshot)
    moved = clone_subject(subject)
    patcher = moved.patcher
    patcher.device_control_placement = None
    patcher.device_control_split = placement
    # Its own identity for ComfyUI's books: another clone of this model (ComfyUI's own nodes on another branch)
    # then sees weights it did not place, and ComfyUI's unpatch gives them back before that clone loads.
    patcher.patches_uuid = uuid.uuid4()
    patcher.load_device = backend_of(placement.first).comfy_device(placement.first)
    check_fits(plan_split(request_of(patcher, placement)), placement, snapshot)  # before any weight moves
    if mode == "pipeline" and hasattr(getattr(patcher.model, "diffusion_model", None), "output_blocks"):
        patcher.set_model_output_block_patch(join_skip)  # a UNet's skip connections join on the hidden state's device
    log.info("[Device Control] Split Model Across Devices: %s, %s", moved.name, placement)
    surface.load_models_gpu([patcher])
    if not split_in_force(patcher):
        raise DeviceControlError(
            f"Split Model Across Devices could not place {moved.name}: ComfyUI's load did not go through Device "
            "Control. Another custom node pack may replace ComfyUI's model loading (load_models_gpu or the "
            "ModelPatcher's load methods): disable it and queue again."
        )
    lines = [f"{moved.name} {split_of(patcher.model).summary()}", f"  before: {before}"]
    lines += [f"  warning: {warning}" for warning in warnings]
    text = "\n".join(lines)
    log.info("[Device Control] Split Model Across Devices: %s", text)
    return MoveResult(moved.value, text)


#: Room left on every accelerator for activations when the allocation is ``auto``.
AUTO_RESERVE = 512 * 1024**2


def resolve_allocation(
    text: str, mode: str, inventory: DeviceInventory, snapshot: InventorySnapshot
) -> tuple[SplitPlacement, list[str]]:
    """``text`` parsed and its devices found on this machine; warnings for devices it lacks (left out, so a
    workflow from another machine still runs; RAM takes what no device is left to hold).

    Raises:
        InvalidAllocationError: malformed, a device named twice (also as two names of one device), or an
            unknown mode.
    """
    if mode not in MODES:
        raise InvalidAllocationError(f"unknown mode '{mode}': choose 'pipeline' or 'stream'.")
    allocation = parse_allocation(text)
    if allocation.is_auto:
        allocation = auto_allocation(_free_memory(inventory, snapshot), AUTO_RESERVE)
    entries, warnings = _entries_here(allocation, text, inventory, snapshot)
    if not entries or (warnings and not entries[-1].takes_rest):
        if any(str(entry.device) == "cpu" for entry in entries):
            raise InvalidAllocationError(f"devices of '{text}' are missing here: {'; '.join(warnings)}")
        entries.append(Entry(DeviceSpec("cpu")))
        warnings.append("what the missing devices would hold stays in RAM (cpu=*)")
    targets = tuple((str(e.device), inventory.target(str(e.device), snapshot)) for e in entries)
    return SplitPlacement(Allocation(tuple(entries)), mode, targets, text), warnings


def _entries_here(
    allocation: Allocation, text: str, inventory: DeviceInventory, snapshot: InventorySnapshot
) -> tuple[list[Entry], list[str]]:
    """The allocation's entries for the devices this machine has (named by their ids), and a warning for each
    device it lacks."""
    entries: list[Entry] = []
    warnings: list[str] = []
    for entry in allocation.entries:
        try:
            found = inventory.resolve(str(entry.device), snapshot=snapshot).device.id
        except DeviceNotFoundError as exc:
            warnings.append(f"{exc} Left out of the split.")
            continue
        if any(str(e.device) == found for e in entries):
            raise InvalidAllocationError(f"'{entry.device}' is {found}, named twice in '{text}': name it once.")
        entries.append(Entry(parse_device_spec(found), entry.size, entry.share))
    return entries, warnings


def _free_memory(inventory: DeviceInventory, snapshot: InventorySnapshot) -> dict[DeviceSpec, int]:
    """Free bytes on every usable device (``auto``'s order), the CPU included."""
    free = {}
    for info in snapshot.devices:
        if info.id and info.error is None and info.free is not None:
            free[parse_device_spec(info.id)] = int(info.free)
    return free


def check_fits(split: Split, placement: SplitPlacement, snapshot: InventorySnapshot) -> None:
    """Refuse, before anything moves, a part larger than its whole device.

    Raises:
        InvalidAllocationError: with the device, the part and what it has.
    """
    ids = dict(placement.targets)
    for part in split.parts:
        info = snapshot.get(str(part.device))
        if info is None or info.total is None or same_target(ids[str(part.device)], HOST):
            continue
        if part.nbytes > info.total:
            raise InvalidAllocationError(
                f"{part.device} has {format_bytes(info.total)} in all, and its part of this model is "
                f"{format_bytes(part.nbytes)}: give it a smaller size or share, or add another device."
            )


def join_skip(h: torch.Tensor, skip: torch.Tensor, _options: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """ComfyUI's ``output_block_patch``: a UNet's skip connection joins the hidden state on its device."""
    return h, hop_beside(skip, h)


def kind_check(subject: Subject) -> None:
    """A MODEL or a CLIP is shared out.

    Raises:
        DeviceControlError: a VAE, or another kind of model, with what to do instead.
    """
    if subject.kind == "VAE":
        raise DeviceControlError(
            "a VAE cannot be split: it decodes one image in one piece and is small; put it on one device with "
            "Move To GPU (or Load VAE With Device)."
        )
    if subject.kind not in ("MODEL", "CLIP"):
        raise DeviceControlError(
            f"a {subject.name} cannot be split: Split Model shares out a MODEL or a CLIP; put it on one device "
            "with Move To GPU."
        )
