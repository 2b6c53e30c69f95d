"""The one rule for a device this machine does not have (a workflow saved on another machine): every node that
takes a device falls back to ``auto`` (ComfyUI's choice for what it places), runs, and says so in the same words.
"""

from __future__ import annotations

from ...core.devices.backends import DeviceInfo
from ...core.devices.inventory import DeviceInventory, InventorySnapshot
from ...core.errors import DeviceNotFoundError

#: What a node does instead, after the problem ``device 'gpu:3' does not exist on this machine (devices here: ...)``.
FALLBACK = "using auto (ComfyUI's choice) instead"


def fallback_note(problem: str) -> str:
    """The warning for a missing device: the problem, then the fallback."""
    return f"{problem}; {FALLBACK}"


def resolve_or_fallback(
    inventory: DeviceInventory, spec: str, snapshot: InventorySnapshot
) -> tuple[DeviceInfo | None, str | None]:
    """The device ``spec`` names, or ``None`` (use ``auto``) with the warning when this machine lacks it.

    Raises:
        InvalidDeviceSpecError: ``spec`` is malformed (a typo, not a portable workflow).
    """
    try:
        return inventory.resolve(spec, snapshot=snapshot).device, None
    except DeviceNotFoundError as exc:
        return None, fallback_note(exc.problem)
