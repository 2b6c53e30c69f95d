"""A simulated GPU for the in-process tests: the pack's nodes see it as ``gpu:0``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

GiB = 1024**3


def with_simulated_gpu(
    module: Callable[[str], Any], monkeypatch: Any, users: Iterable[str], capacity: int = 8 * GiB
) -> Any:
    """A simulated GPU of ``capacity`` bytes, in the device inventory of the pack's modules ``users`` (the nodes
    that list or place devices); returns the device."""
    return with_simulated_gpus(module, monkeypatch, users, 1, capacity)[0]


def with_simulated_gpus(
    module: Callable[[str], Any], monkeypatch: Any, users: Iterable[str], count: int, capacity: int = 8 * GiB
) -> list[Any]:
    """``count`` simulated GPUs of ``capacity`` bytes each, as :func:`with_simulated_gpu` gives one."""
    sims = [module("core.devices.sim.device").SimulatedDevice(capacity, ordinal=i) for i in range(count)]
    inventory = module("core.devices.inventory").DeviceInventory(
        extra=module("core.devices.backends").simulated_backends(sims)
    )
    for user in users:
        monkeypatch.setattr(module(user), "inventory", inventory)
    return sims
