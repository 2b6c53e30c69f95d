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

from ...core.devices.backends import backend_of
from ...core.devices.inventory import DeviceInventory
from ...core.errors import DeviceControlError
from ...core.placement.split_model import plan_split, split_of
from .. import surface
from .foreign import placeable
from .moves import MoveResult, clone_subject, state_before
from .splits import check_fits, join_skip, kind_check, request_of, resolve_allocation, split_in_force
from .subjects import require_subject

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
