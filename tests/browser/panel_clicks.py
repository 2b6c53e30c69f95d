"""Clicks on the Devices panel's buttons, as a user makes them."""

from __future__ import annotations

from typing import Any

from playwright.sync_api import TimeoutError as PlaywrightTimeout

#: How many times a button is clicked before the test gives up on its confirmation dialog.
ATTEMPTS = 3


def click_and_confirm(page: Any, button: Any) -> None:
    """Click a panel button that asks first (Offload, Offload all), then the dialog's Confirm.

    Each push of the panel's data builds its model rows, buttons included, anew: on a loaded machine a click can
    land on a row that is being replaced, and no dialog opens (seen once with frontend 1.58.1, the 0.3.75
    integration tier running beside). A user clicks again; so does this, while no dialog shows."""
    confirm = page.get_by_role("button", name="Confirm")
    for _ in range(ATTEMPTS):
        if not confirm.is_visible():
            try:
                button.click(timeout=10_000)
            except PlaywrightTimeout:
                continue
        try:
            confirm.wait_for(state="visible", timeout=10_000)
        except PlaywrightTimeout:
            continue
        confirm.click()
        return
    raise AssertionError(f"no confirmation dialog after {ATTEMPTS} clicks on the panel's button")
