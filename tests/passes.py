"""Which ComfyUI's pass a test runs in: the integration and browser tiers run once per ComfyUI we test
(``tools/run_tests.py``); a costly check whose outcome does not depend on the ComfyUI version runs once, in the
newest version's pass (the first), marked :data:`ONCE`."""

from __future__ import annotations

import pytest

from tools.runtime import DEFAULT_VERSION, NEWEST_VERSION

#: Whether this pass is the newest ComfyUI's.
NEWEST_PASS = DEFAULT_VERSION == NEWEST_VERSION

#: Runs in the newest ComfyUI's pass only.
ONCE = pytest.mark.skipif(not NEWEST_PASS, reason="runs once, in the newest version's pass")
