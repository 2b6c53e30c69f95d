"""The pack's process-wide state inside ComfyUI: the device inventory, simulated devices included.

Simulated devices exist only when ``DEVICE_CONTROL_SIMULATE_GPU`` is set (see ``core.devices``). A value
that cannot be parsed is logged with the fix and ignored: a typo in an environment variable must never
keep ComfyUI or the pack from starting.
"""

from __future__ import annotations

import logging

from ..core.devices import SIMULATE_ENV, DeviceInventory, simulated_devices_from_env
from ..core.simulated import SimulatedDevice
from ..core.units import format_bytes

log = logging.getLogger("device_control")


def _simulated_from_env() -> list[SimulatedDevice]:
    try:
        devices = simulated_devices_from_env()
    except ValueError as exc:
        log.error(
            "[Device Control] %s is invalid (%s); no simulated GPU this run. Example: %s=8GiB",
            SIMULATE_ENV,
            exc,
            SIMULATE_ENV,
        )
        return []
    for device in devices:
        log.info(
            "[Device Control] simulated GPU %s with %s (from %s)",
            device.label,
            format_bytes(device.capacity),
            SIMULATE_ENV,
        )
    return devices


inventory = DeviceInventory(simulated=_simulated_from_env())
