"""Stand-in for ``av.error`` (see the package's docstring)."""

from __future__ import annotations

from . import Unavailable, stand_in


def __getattr__(attr: str) -> Unavailable:
    return stand_in(__name__, attr)
