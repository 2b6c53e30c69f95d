"""What the environment asks of the simulated GPU: how many devices, their capacities, the faults they inject,
what other programs hold on them and what a copy over their link costs.

A ComfyUI started with ``DEVICE_CONTROL_SIMULATE_GPU`` sees these devices beside (or instead of) real ones; the
devices themselves (``core.devices.sim.device``) know nothing of the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ...units import parse_size
from .cost import LINK_ENV, LinkCost
from .device import SimulatedDevice

#: Faults a simulated device can be told to inject (see ``SimulatedDevice(faults=...)``):
#: ``stats``: memory statistics queries fail, as a broken driver query would;
#: ``unreported_others``: what other programs use is left out of :meth:`SimulatedDevice.free` and the
#: statistics, but still takes room, as when another program allocates between a query and a move;
#: ``slow_moves``: every placement on the device and every release from it takes a few milliseconds, so a move
#: can be interrupted half-way, and an offload lasts long enough to act meanwhile, in tests.
KNOWN_FAULTS = frozenset({"stats", "unreported_others", "slow_moves"})


SIMULATE_ENV = "DEVICE_CONTROL_SIMULATE_GPU"
SIMULATE_FAULTS_ENV = "DEVICE_CONTROL_SIMULATE_FAULTS"
SIMULATE_OTHERS_ENV = "DEVICE_CONTROL_SIMULATE_USED_BY_OTHERS"


@dataclass(frozen=True)
class SimulatedSpec:
    """What ``DEVICE_CONTROL_SIMULATE_GPU`` asked for: one capacity per simulated device."""

    capacities: tuple[int, ...]
    faults: frozenset[str] = frozenset()
    link: LinkCost = field(default_factory=LinkCost)

    @classmethod
    def parse(cls, capacities: str | None, faults: str | None = None, link: str | None = None) -> SimulatedSpec:
        """Parse ``"8GiB"`` or ``"8GiB,4GiB"`` (one device each), an optional fault list and a link cost.

        Raises:
            InvalidSizeError: a capacity is not a size, or the link is not a bandwidth and latency.
            ValueError: a fault name is unknown.
        """
        sizes = tuple(parse_size(part) for part in (capacities or "").split(",") if part.strip())
        names = frozenset(part.strip() for part in (faults or "").split(",") if part.strip())
        unknown = names - KNOWN_FAULTS
        if unknown:
            raise ValueError(f"unknown simulated fault(s) {sorted(unknown)}; known faults: {sorted(KNOWN_FAULTS)}.")
        return cls(sizes, names, LinkCost.parse(link))


def simulated_devices_from_env(environ: dict[str, str] | None = None) -> list[SimulatedDevice]:
    """The simulated devices asked for by ``DEVICE_CONTROL_SIMULATE_GPU`` (none when it is unset).

    ``DEVICE_CONTROL_SIMULATE_GPU=8GiB`` makes one device, ``8GiB,4GiB`` two.
    ``DEVICE_CONTROL_SIMULATE_USED_BY_OTHERS=1GiB`` pretends another process holds that much on each;
    ``DEVICE_CONTROL_SIMULATE_FAULTS=stats`` makes their statistics queries fail (fault tests);
    ``DEVICE_CONTROL_SIMULATE_LINK=16GB/s,10us`` makes copies to and from them take that time (free if unset).

    Raises:
        InvalidSizeError: a size in the variables cannot be parsed.
        ValueError: an unknown fault is named.
    """
    env = os.environ if environ is None else environ
    spec = SimulatedSpec.parse(env.get(SIMULATE_ENV), env.get(SIMULATE_FAULTS_ENV), env.get(LINK_ENV))
    others = parse_size(env.get(SIMULATE_OTHERS_ENV) or 0)
    return [
        SimulatedDevice(capacity, ordinal=i, used_by_others=others, faults=spec.faults, link=spec.link)
        for i, capacity in enumerate(spec.capacities)
    ]
