"""Memory sizes: parsing what users type and formatting what we show.

Sizes are binary throughout, because that is how drivers, ``nvidia-smi`` and ComfyUI itself count
memory: ``"8GB"`` and ``"8GiB"`` both mean 8 x 1024**3 bytes. Output always uses the unambiguous binary
suffixes (KiB, MiB, GiB, TiB).
"""

from __future__ import annotations

import math
import re

from .errors import InvalidSizeError

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1024,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1024**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1024**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1024**4,
    "tib": 1024**4,
}

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)

_EXAMPLES = "write it like '8GiB', '512MB' or '1.5GB'"


def parse_size(text: str | int | float) -> int:
    """Parse a memory size such as ``"8GiB"``, ``"512 MB"`` or ``1073741824`` into bytes.

    Args:
        text: the size as typed by a user, or a number of bytes.

    Returns:
        The size in bytes, rounded down to a whole byte.

    Raises:
        InvalidSizeError: the text is not a size, or the size is negative, NaN or infinite.
    """
    if isinstance(text, bool):
        raise InvalidSizeError(f"{text!r} is not a memory size; {_EXAMPLES}.")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = _SIZE_RE.match(str(text))
        if match is None:
            stripped = str(text).strip()
            if stripped.startswith("-"):
                raise InvalidSizeError(f"memory size {text!r} is negative; sizes must be 0 or more.")
            raise InvalidSizeError(f"{text!r} is not a memory size; {_EXAMPLES}.")
        value, unit = float(match.group(1)), match.group(2).lower()
        if unit not in _UNITS:
            raise InvalidSizeError(f"unknown unit {match.group(2)!r} in {text!r}; use B, KiB, MiB, GiB or TiB.")
    if math.isnan(value) or math.isinf(value):
        raise InvalidSizeError(f"memory size {text!r} is not a finite number; {_EXAMPLES}.")
    if value < 0:
        raise InvalidSizeError(f"memory size {text!r} is negative; sizes must be 0 or more.")
    return int(value * _UNITS[unit])


def format_bytes(count: int | float | None) -> str:
    """Format a byte count for people: ``1536`` -> ``"1.50 KiB"``; ``None`` -> ``"n/a"``."""
    if count is None:
        return "n/a"
    sign = "-" if count < 0 else ""
    value = float(abs(count))
    for suffix in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{sign}{int(value)} B" if suffix == "B" else f"{sign}{value:.2f} {suffix}"
        value /= 1024
    return f"{sign}{value:.2f} TiB"
