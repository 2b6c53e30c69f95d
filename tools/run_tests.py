"""Run every test tier: provision the runtime (ComfyUI, packages, Chromium), lint, then pytest: every tier on
ComfyUI 0.3.75, then the integration and browser tiers on 0.3.52 and on 0.28.0.

ComfyUI 0.28.0 comes from a source archive beside the repository (``../shared/comfyui/``); where it is absent
(a user's clone) its tiers are skipped with one line, and under ``CI=true`` that is a failure.

    python3 tools/run_tests.py            # everything; extra arguments go to pytest (each pass)

Every tier must run: a tier that cannot (no ComfyUI, no Chromium) fails instead of being skipped.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from any folder

from tools.runtime import RELEASES, REPO, TESTED_VERSIONS, missing_source, provision

log = logging.getLogger("device_control.tools")
#: Each pass ends with its slowest tests: where the time of a run goes, in every CI log.
DURATIONS = ("--durations=25",)
#: What a run from a fresh clone writes, in GB (du after one): the runtime in .runtime (packages and ComfyUI, 7),
#: the synthetic models in .runtime/fixtures (14, sparse files counted as what they use), and pytest's folder
#: (one module's files at a time: at most 0.9 seen).
DISK_NEEDED_GB = 23
ROOM = f"a run from a fresh clone writes about {DISK_NEEDED_GB} GB; make that much room and run again."


def disk_free_gb() -> float:
    """Free space on the disk the runtime and pytest's folders are written to."""
    return shutil.disk_usage(REPO).free / 1e9


def arguments(argv: list[str]) -> list[str]:
    """The arguments for pytest; ``--help`` prints how to use this command (and provisions nothing)."""
    parser = argparse.ArgumentParser(
        prog="python3 tools/run_tests.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
        epilog=(
            "Any other argument goes to pytest, in each pass: a tier (tests/core), a test (-k soak), or this "
            "repository's own options: --soak-cycles N (the long soak runs 200)."
        ),
    )
    return parser.parse_known_args(argv)[1]


def main() -> int:
    pytest_args = arguments(sys.argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.monotonic()
    log.info(
        "[Device Control] %.1f GB free on the disk; a run from a fresh clone writes about %d GB",
        disk_free_gb(),
        DISK_NEEDED_GB,
    )
    absent = {version: missing_source(version) for version in RELEASES if missing_source(version)}
    for version, reason in absent.items():
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            log.error("[Device Control] FAILED: %s; CI runs every ComfyUI we test.", reason)
            return 1
        log.warning("[Device Control] SKIPPED the ComfyUI %s tiers: %s.", version, reason)
    python = provision(browser=True, versions=tuple(v for v in RELEASES if v not in absent))
    env = {**os.environ, "DEVICE_CONTROL_REQUIRE_ALL_TIERS": "1"}
    primary, *older = (v for v in TESTED_VERSIONS if v not in absent)
    steps: list[tuple[str, list[str]]] = [
        ("", [str(python), "-m", "ruff", "check", "."]),
        ("", [str(python), "-m", "ruff", "format", "--check", "."]),
        (primary, [str(python), "-m", "pytest", *DURATIONS, *pytest_args]),
    ]
    # The tiers that run ComfyUI, again on each older version (core/ does not depend on ComfyUI).
    tiers = pytest_args or ["tests/integration", "tests/browser"]
    steps += [(version, [str(python), "-m", "pytest", *DURATIONS, *tiers]) for version in older]
    for version, step in steps:
        label = " ".join(step[2:]) + (f" (ComfyUI {version})" if version else "")
        log.info("[Device Control] $ %s", label)
        run_env = {**env, "DEVICE_CONTROL_COMFYUI": version} if version else env
        if subprocess.run(step, cwd=REPO, env=run_env, check=False).returncode != 0:
            log.error("[Device Control] FAILED: %s (after %.0f s)", label, time.monotonic() - started)
            if disk_free_gb() < 2:
                log.error("[Device Control] The disk is full (%.1f GB free): %s", disk_free_gb(), ROOM)
            return 1
    log.info("[Device Control] all test tiers passed in %.0f s", time.monotonic() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
