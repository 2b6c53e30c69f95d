"""VRAM budgets and placements: how much of a device one model may use, as users type it, and where it lives.

A budget is ``"all"`` (as much as the model needs, if the device has it), a size (``"6GB"``, ``"1.5 GiB"``,
binary units as everywhere in the pack) or a share of the device (``"50%"``). It covers the model's
resident weights *and* the room its streamed layers need while they are cast, so a budget is what the
model takes from the device at most, not counting the activations of the computation itself.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..devices.memory import capacity_bytes
from ..devices.tensors import Target, label_of
from ..errors import InvalidSizeError
from ..units import format_bytes, parse_size

_PERCENT_RE = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+|nan|inf)\s*%\s*$", re.IGNORECASE)
_FORMS = "'all', a size such as '6GB' or '512MiB', or a share of the device such as '50%'"


def _share(text: str) -> float:
    """``"50%"`` -> 0.5.

    Raises:
        InvalidSizeError: not a percentage, or outside 0 to 100 %.
    """
    match = _PERCENT_RE.match(text)
    if match is None:
        raise InvalidSizeError(f"VRAM budget {text!r} is not a share of the device; write it like '50%'.")
    share = float(match.group(1))
    if math.isnan(share) or math.isinf(share) or not 0 <= share <= 100:
        raise InvalidSizeError(f"VRAM budget {text!r} must be a share between 0% and 100% of the device.")
    return share / 100


@dataclass(frozen=True)
class Budget:
    """A budget as the user wrote it; :meth:`resolve` turns it into bytes for one device.

    ``size`` and ``fraction`` are both ``None`` for ``"all"``.
    """

    size: int | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, text: str | int | float | None) -> Budget:
        """Parse ``"all"``, ``"6GB"`` or ``"50%"`` (an empty text means ``"all"``).

        Raises:
            InvalidSizeError: not one of the accepted forms, negative, NaN, or a share above 100 %.
        """
        if text is None or (isinstance(text, str) and text.strip().lower() in ("", "all")):
            return ALL
        if isinstance(text, str) and "%" in text:
            return cls(fraction=_share(text))
        if isinstance(text, str) and text.strip().lower().lstrip("+-") in ("nan", "inf", "infinity"):
            raise InvalidSizeError(f"VRAM budget {text!r} is not a finite number. Accepted forms: {_FORMS}.")
        try:
            return cls(size=parse_size(text))
        except InvalidSizeError as exc:
            raise InvalidSizeError(f"VRAM budget: {exc} Accepted forms: {_FORMS}.") from None

    @property
    def is_all(self) -> bool:
        """Whether this is ``"all"``: the whole model if it fits."""
        return self.size is None and self.fraction is None

    def resolve(self, capacity: int, *, device: str = "the device") -> int:
        """Bytes this budget allows on a device of ``capacity`` bytes.

        Raises:
            InvalidSizeError: an absolute budget larger than the device (the fix names the largest one).
        """
        if self.size is not None:
            if self.size > capacity:
                raise InvalidSizeError(
                    f"VRAM budget {format_bytes(self.size)} is larger than {device}, which holds "
                    f"{format_bytes(capacity)}; use at most that, a share such as '90%', or 'all'."
                )
            return self.size
        if self.fraction is not None:
            return int(capacity * self.fraction)
        return capacity

    def __str__(self) -> str:
        if self.size is not None:
            return format_bytes(self.size)
        if self.fraction is not None:
            return f"{self.fraction * 100:g}%"
        return "all"


#: The whole model, as far as the device has room.
ALL = Budget()


@dataclass(frozen=True)
class Placement:
    """Where a model should live: its compute device, its budget there, and whether it may be evicted.

    ``device_id`` is the user's name for the device (``gpu:0``), for messages.
    """

    target: Target
    budget: Budget = ALL
    keep_resident: bool = False
    device_id: str = ""

    @property
    def name(self) -> str:
        """The device's name in messages: the user's, else the backend's."""
        return self.device_id or label_of(self.target)

    def budget_bytes(self) -> int:
        """The budget in bytes on this device now.

        Raises:
            InvalidSizeError: an absolute budget larger than the device.
        """
        return self.budget.resolve(capacity_bytes(self.target), device=self.name)
