"""The pack's process-wide state inside ComfyUI: the device inventory (simulated devices included) and the
settings read from the environment at start.

Simulated devices exist only when ``DEVICE_CONTROL_SIMULATE_GPU`` is set (see ``core.devices``), a simulated
platform only when ``DEVICE_CONTROL_SIMULATE_PLATFORM`` is (``core.devices.sim.platforms``); pinned host
memory is capped by ``DEVICE_CONTROL_MAX_PINNED_FRACTION``; ``DEVICE_CONTROL_PREFETCH=off`` turns prefetch of
streamed layers off. A value that cannot be parsed is logged with the
fix and ignored: a typo in an environment variable must never keep ComfyUI or the pack from starting.
"""

from __future__ import annotations

import logging

from ..core.devices.backends import SIMULATE_ENV, SimulatedDevice, simulated_backends, simulated_devices_from_env
from ..core.devices.host_memory import use_platform
from ..core.devices.inventory import DeviceInventory
from ..core.devices.pinned import DEFAULT_PINNED_FRACTION, pinned_fraction_from_env, use_pinned_fraction
from ..core.devices.sim.platforms import PLATFORM_ENV, platform_from_env
from ..core.errors import InvalidSizeError
from ..core.placement.prefetch import PREFETCH_ENV, prefetch_from_env, use_prefetch
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
            "[Device Control] simulated GPU gpu:%d with %s (from %s)",  # named as the nodes name it
            device.ordinal,
            format_bytes(device.capacity),
            SIMULATE_ENV,
        )
    return devices


def _pinning_from_env() -> None:
    try:
        use_pinned_fraction(pinned_fraction_from_env())
    except InvalidSizeError as exc:
        log.error(
            "[Device Control] %s Pinned host memory stays capped at %d %% of RAM this run.",
            exc,
            round(DEFAULT_PINNED_FRACTION * 100),
        )
        use_pinned_fraction(DEFAULT_PINNED_FRACTION)


def _platform_from_env() -> None:
    try:
        chosen = platform_from_env()
    except ValueError as exc:
        log.error("[Device Control] %s: %s; this machine's own platform is used.", PLATFORM_ENV, exc)
        return
    if chosen is not None:
        use_platform(chosen)
        log.info(
            "[Device Control] simulated platform %s (from %s): its pages, mmap and driver limits",
            chosen.name,
            PLATFORM_ENV,
        )


def _prefetch_from_env() -> None:
    try:
        use_prefetch(prefetch_from_env())
    except InvalidSizeError as exc:
        log.error("[Device Control] %s Prefetch stays on this run (%s=off turns it off).", exc, PREFETCH_ENV)
        use_prefetch(True)


_platform_from_env()
inventory = DeviceInventory(extra=simulated_backends(_simulated_from_env()))
_pinning_from_env()
_prefetch_from_env()


def device_options() -> list[str]:
    """The devices a node offers: ``auto`` (ComfyUI's choice), ``cpu``, then every accelerator (``gpu:N``)."""
    return ["auto", "cpu", *(d.id for d in inventory.snapshot().devices if d.is_accelerator and d.id)]


def device_tooltip(text: str) -> str:
    """A device input's tooltip: ``text``, then what hides GPUs the driver has from ComfyUI, and the fix (the
    device list is where a user misses them first)."""
    return " ".join([text, *inventory.snapshot().notes])
