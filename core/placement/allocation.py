"""How one model is shared out over several devices, as users type it: an *allocation*.

    gpu:0=10GB, gpu:1=12GB, cpu=*     sizes: what each device may hold at most; ``*`` takes the rest
    gpu:0=40%, gpu:1=60%              shares of the model
    auto                              fill the devices in order of free memory, keeping room for activations

The devices are named as everywhere in the pack (``gpu:N``, ``cpu``, a backend's ``cuda:N``...), each once; sizes
are binary (``"10GB"`` is 10 GiB); shares add up to at most 100 %. The order of the entries is the order the
model's layers fill the devices in (its first layers on the first device), so a user decides which device holds
the start of the model. :func:`parse_allocation` checks the text only; :meth:`Allocation.capacities` turns it into
bytes for one model, and :mod:`core.placement.split` places the model's blocks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..devices.inventory import DeviceSpec, parse_device_spec
from ..errors import InvalidAllocationError, InvalidDeviceSpecError, InvalidSizeError
from ..units import format_bytes, parse_size

#: The grammar, as every refusal of a malformed allocation shows it.
GRAMMAR = (
    "write it as 'gpu:0=10GB, gpu:1=12GB, cpu=*' (sizes; '*' takes the rest), 'gpu:0=40%, gpu:1=60%' (shares of "
    "the model) or 'auto' (devices filled in order of free memory)"
)
_SHARE_RE = re.compile(r"^([0-9]*\.?[0-9]+)\s*%$")


@dataclass(frozen=True)
class Entry:
    """One device of an allocation and what it may hold: ``size`` bytes, a ``share`` of the model (0 to 1), or
    the rest (both ``None``)."""

    device: DeviceSpec
    size: int | None = None
    share: float | None = None

    @property
    def takes_rest(self) -> bool:
        """Whether this device takes what the other entries leave (``*``)."""
        return self.size is None and self.share is None

    def __str__(self) -> str:
        if self.size is not None:
            return f"{self.device}={format_bytes(self.size)}"
        if self.share is not None:
            return f"{self.device}={self.share * 100:g}%"
        return f"{self.device}=*"


@dataclass(frozen=True)
class Allocation:
    """A parsed allocation: its entries in the order the model fills them, or ``auto`` (no entries)."""

    entries: tuple[Entry, ...] = ()

    @property
    def is_auto(self) -> bool:
        """Whether the devices are to be chosen by their free memory."""
        return not self.entries

    def capacities(self, model_bytes: int) -> list[tuple[DeviceSpec, int]]:
        """Bytes each device may hold of a model of ``model_bytes``, in fill order: a size as given, a share of the
        model, and for ``*`` what the others leave (never below 0).

        Raises:
            InvalidAllocationError: on ``auto``, whose capacities come from the devices' free memory.
        """
        if self.is_auto:
            raise InvalidAllocationError("'auto' has no fixed capacities: they come from the devices' free memory.")
        fixed = [
            entry.size if entry.size is not None else int(model_bytes * entry.share)
            for entry in self.entries
            if not entry.takes_rest
        ]
        rest = max(0, model_bytes - sum(fixed))
        sizes = iter(fixed)
        return [(entry.device, rest if entry.takes_rest else next(sizes)) for entry in self.entries]

    def __str__(self) -> str:
        return ", ".join(str(entry) for entry in self.entries) if self.entries else "auto"


AUTO = Allocation()


def parse_allocation(text: str) -> Allocation:
    """Parse an allocation string (see the module's docstring; case and spaces do not matter).

    Raises:
        InvalidAllocationError: malformed (the message shows the grammar), a device named twice, ``auto`` as a
            device, more than one ``*``, a share over 100 % or shares adding up to more, a size that is not one.
    """
    stripped = str(text).strip()
    if stripped.lower() == "auto":
        return AUTO
    if not stripped:
        raise InvalidAllocationError(f"the allocation is empty; {GRAMMAR}.")
    entries = tuple(_entry(part.strip(), stripped) for part in stripped.split(","))
    _check(entries, stripped)
    return Allocation(entries)


def _entry(part: str, whole: str) -> Entry:
    device_text, equals, amount = part.partition("=")
    if not equals or not device_text.strip() or not amount.strip():
        raise InvalidAllocationError(f"{part!r} in allocation {whole!r} is not 'device=amount'; {GRAMMAR}.")
    device = _device(device_text, whole)
    return _amount(amount.strip(), device, whole)


def _device(text: str, whole: str) -> DeviceSpec:
    try:
        device = parse_device_spec(text)
    except InvalidDeviceSpecError as exc:
        raise InvalidAllocationError(f"allocation {whole!r}: {exc}") from None
    if device.kind == "auto":
        raise InvalidAllocationError(
            f"allocation {whole!r} names the device 'auto'; name each device ('gpu:0', 'cpu'), or write just 'auto'."
        )
    return device


def _amount(amount: str, device: DeviceSpec, whole: str) -> Entry:
    if amount == "*":
        return Entry(device)
    share = _SHARE_RE.match(amount)
    if share is not None:
        value = float(share.group(1))
        if not math.isfinite(value) or value > 100:
            raise InvalidAllocationError(
                f"allocation {whole!r} gives {device} {amount}: a share is of the model, at most 100%."
            )
        return Entry(device, share=value / 100)
    try:
        return Entry(device, size=parse_size(amount))
    except InvalidSizeError as exc:
        raise InvalidAllocationError(f"allocation {whole!r}, {device}: {exc} Or {GRAMMAR}.") from None


def _check(entries: Sequence[Entry], whole: str) -> None:
    seen: set[DeviceSpec] = set()
    for entry in entries:
        if entry.device in seen:
            raise InvalidAllocationError(
                f"allocation {whole!r} names {entry.device} twice; give each device once, with all it may hold."
            )
        seen.add(entry.device)
    if sum(entry.takes_rest for entry in entries) > 1:
        raise InvalidAllocationError(
            f"allocation {whole!r} has more than one '*'; one device takes the rest, the others a size or a share."
        )
    shares = sum(entry.share for entry in entries if entry.share is not None)
    if shares > 1 + 1e-9:
        raise InvalidAllocationError(
            f"the shares of allocation {whole!r} add up to {shares * 100:g}%; they may add up to 100% at most "
            "(give the last device '*' to take the rest)."
        )
