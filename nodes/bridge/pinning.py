"""ComfyUI's page-locked host memory and ours, in one set of books.

ComfyUI page-locks host memory too (``comfy.model_management.pin_memory``: its offloaded weights, under a cap of its
own, 40 % of RAM on Windows in 0.33). The two never see each other's registrations unless told, and a registration
that touches a page the other registered fails; on Windows the driver also refuses page-locking past about half of
RAM. So the pack's books count ComfyUI's registrations against its one cap, and refuse ranges on their pages
(``core.devices.pinned``); this module tells them where ComfyUI keeps its books, and says in VRAM Report and the
panel who holds what, and what limits it.
"""

from __future__ import annotations

import sys

from ...core.devices.host_memory import platform
from ...core.devices.pinned import count_foreign_registrations, pinned_memory
from ...core.units import format_bytes
from .. import surface


def count_comfyuis_registrations() -> None:
    """From now on, count ComfyUI's own pinned ranges in the pack's books (at start, inside ComfyUI)."""
    count_foreign_registrations(surface.comfy_pinned_ranges)


def pinned_figures() -> dict[str, int | None]:
    """The pinned-memory fields of ComfyUI's memory mode: ComfyUI's cap, the pack's bytes, the one cap."""
    return {
        "comfy_pinned_cap": surface.comfy_pinned_cap(),
        "pack_pinned_bytes": pinned_memory().pinned_bytes,
        "pinned_cap": pinned_memory().max_bytes,
    }


def pinning_notes() -> list[str]:
    """What limits page-locked memory here, and what to start ComfyUI with to change it."""
    notes = []
    if surface.comfy_pinned_cap() == 0 and "--disable-pinned-memory" in sys.argv:
        notes.append(
            "ComfyUI pins no host memory (started with --disable-pinned-memory), so its own offloaded copies block; "
            "start it without that option to pin them. Device Control still page-locks what it streams, within "
            f"its cap of {format_bytes(pinned_memory().max_bytes)} (DEVICE_CONTROL_MAX_PINNED_FRACTION=0 turns "
            "that off)."
        )
    driver = platform().registration_cap()
    if driver is not None:
        notes.append(
            f"The driver page-locks at most about {round(platform().registration_limit * 100)} % of RAM on this "
            f"system ({platform().name}): ComfyUI's pinned memory and Device Control's share one cap of "
            f"{format_bytes(pinned_memory().max_bytes)}."
        )
    return notes
