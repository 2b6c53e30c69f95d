"""Run every test tier: provision the runtime (ComfyUI, packages, Chromium), lint, then pytest.

    python3 tools/run_tests.py            # everything; extra arguments go to pytest

Every tier must run: a tier that cannot (no ComfyUI, no Chromium) fails instead of being skipped.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from any folder

from tools.runtime import REPO, provision

log = logging.getLogger("device_control.tools")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.monotonic()
    python = provision(browser=True)
    env = {**os.environ, "DEVICE_CONTROL_REQUIRE_ALL_TIERS": "1"}
    steps = [
        [str(python), "-m", "ruff", "check", "."],
        [str(python), "-m", "ruff", "format", "--check", "."],
        [str(python), "-m", "pytest", *sys.argv[1:]],
    ]
    for step in steps:
        log.info("[Device Control] $ %s", " ".join(step[1:]))
        if subprocess.run(step, cwd=REPO, env=env, check=False).returncode != 0:
            log.error("[Device Control] FAILED: %s (after %.0f s)", " ".join(step[2:]), time.monotonic() - started)
            return 1
    log.info("[Device Control] all test tiers passed in %.0f s", time.monotonic() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
