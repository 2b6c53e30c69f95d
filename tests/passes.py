"""Which ComfyUI's pass a test runs in: the integration and browser tiers run once per ComfyUI we test
(``tools/run_tests.py``). A costly check whose outcome does not depend on the ComfyUI version runs once, in the
primary version's pass (the first, the one that runs every tier), marked :data:`ONCE`; the long reliability checks
run in the newest tested ComfyUI's pass, marked :data:`LONG` (or take their long form there)."""

from __future__ import annotations

import pytest

from tools.runtime import DEFAULT_VERSION, PRIMARY_VERSION, long_checks_version

#: Whether this pass is the primary ComfyUI's (0.3.75: the one that runs every tier).
PRIMARY_PASS = DEFAULT_VERSION == PRIMARY_VERSION
#: Whether this pass is the one the long reliability checks run in (the newest ComfyUI tested, 0.28.0, where its
#: source archive is there; else the primary one).
LONG_PASS = long_checks_version() == DEFAULT_VERSION

#: Runs in the primary ComfyUI's pass only.
ONCE = pytest.mark.skipif(not PRIMARY_PASS, reason=f"runs once, in the ComfyUI {PRIMARY_VERSION} pass")
#: Runs in the long checks' pass only.
LONG = pytest.mark.skipif(not LONG_PASS, reason=f"a long check: runs in the ComfyUI {long_checks_version()} pass")
