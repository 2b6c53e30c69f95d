"""Run every test tier: provision the runtime (ComfyUI, packages, Chromium), lint, then pytest: every tier on
ComfyUI 0.3.75, then the version checks (integration and browser tiers, ``tests/passes.py``) on 0.28.0 (a part of
them) and on 0.33.0, the newest, whose pass also runs the long reliability checks.

ComfyUI 0.28.0 and 0.33.0 come from source archives beside the repository (``../shared/comfyui/``); where one is
absent (a user's clone) its tiers are skipped with one line, and under ``CI=true`` that is a failure.

    python3 tools/run_tests.py            # everything; extra arguments go to pytest (each pass)
    python3 tools/run_tests.py --quick    # while working on a change: the core tier and one integration test
                                          # per node, on ComfyUI 0.3.75 only (under 10 minutes)

Every tier must run: a tier that cannot (no ComfyUI, no Chromium) fails instead of being skipped.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from any folder

from tests.quick import QUICK
from tools.runtime import PRIMARY_VERSION, RELEASES, REPO, TESTED_VERSIONS, missing_source, provision

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


def arguments(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This command's options and the arguments for pytest; ``--help`` prints how to use this command (and
    provisions nothing)."""
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
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"the core tier and one integration test per node (tests/quick.py), on ComfyUI {PRIMARY_VERSION} "
        "only, without lint or the browser tier: a check while working on a change, not a substitute for the run",
    )
    return parser.parse_known_args(argv)


def main() -> int:
    options, pytest_args = arguments(sys.argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.monotonic()
    log.info(
        "[Device Control] %.1f GB free on the disk; a run from a fresh clone writes about %d GB",
        disk_free_gb(),
        DISK_NEEDED_GB,
    )
    if options.quick:
        python = provision()
        return run_stages(
            [[(PRIMARY_VERSION, [str(python), "-m", "pytest", *DURATIONS, *QUICK, *pytest_args])]], started
        )
    absent = {version: missing_source(version) for version in RELEASES if missing_source(version)}
    for version, reason in absent.items():
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            log.error("[Device Control] FAILED: %s; CI runs every ComfyUI we test.", reason)
            return 1
        log.warning("[Device Control] SKIPPED the ComfyUI %s tiers: %s.", version, reason)
    python = provision(browser=True, versions=tuple(v for v in RELEASES if v not in absent))
    primary, *others = (v for v in TESTED_VERSIONS if v not in absent)
    pytest = [str(python), "-m", "pytest", *DURATIONS]
    lint = [
        ("", [str(python), "-m", "ruff", "check", "."]),
        ("", [str(python), "-m", "ruff", "format", "--check", "."]),
    ]
    if pytest_args:  # what was asked for, in each pass
        stages = [[step] for step in lint] + [[(version, [*pytest, *pytest_args])] for version in (primary, *others)]
        return run_stages(stages, started)
    # The lint, the core tier (it does not import ComfyUI) and the synthetic models the other tiers load run side
    # by side (they take little memory); then the tiers that run ComfyUI, on each version in turn.
    fixtures = (primary, [str(python), "-m", "tools.make_fixtures"])
    stages = [[*lint, (primary, [*pytest, "tests/core"]), fixtures]]
    stages += [[(version, [*pytest, "tests/integration", "tests/browser"])] for version in (primary, *others)]
    return run_stages(stages, started)


Step = tuple[str, list[str]]


def run_stages(stages: list[list[Step]], started: float) -> int:
    """Run each stage in turn, the steps of a stage side by side (a step: a ComfyUI version, or none, and a
    command); stop after the first stage with a step that fails. A stage of several steps prints each one's output
    when it ends, whole, in the order given."""
    env = {**os.environ, "DEVICE_CONTROL_REQUIRE_ALL_TIERS": "1"}
    for stage in stages:
        failed = _run_one(stage[0], env) if len(stage) == 1 else _run_side_by_side(stage, env)
        if failed:
            log.error("[Device Control] FAILED: %s (after %.0f s)", failed, time.monotonic() - started)
            if disk_free_gb() < 2:
                log.error("[Device Control] The disk is full (%.1f GB free): %s", disk_free_gb(), ROOM)
            return 1
        log.info("[Device Control] step done after %.0f s", time.monotonic() - started)
    log.info("[Device Control] all test tiers passed in %.0f s", time.monotonic() - started)
    return 0


def _label(step: Step) -> str:
    version, command = step
    return " ".join(command[2:]) + (f" (ComfyUI {version})" if version else "")


def _env_of(step: Step, env: dict[str, str]) -> dict[str, str]:
    return {**env, "DEVICE_CONTROL_COMFYUI": step[0]} if step[0] else env


def _run_one(step: Step, env: dict[str, str]) -> str | None:
    """Run a step with its output going straight through; the label of a failed step, or ``None``."""
    log.info("[Device Control] $ %s", _label(step))
    done = subprocess.run(step[1], cwd=REPO, env=_env_of(step, env), check=False)
    return _label(step) if done.returncode != 0 else None


def _run_side_by_side(stage: list[Step], env: dict[str, str]) -> str | None:
    """Start every step of ``stage`` at once, then print each one's output in turn; the labels of those that
    failed, or ``None``."""
    with tempfile.TemporaryDirectory(prefix="device-control-steps-") as folder:
        outputs = [Path(folder) / f"{index}.log" for index in range(len(stage))]
        running = []
        for step, output in zip(stage, outputs, strict=True):
            log.info("[Device Control] $ %s (side by side)", _label(step))
            with open(output, "wb") as sink:
                running.append(
                    subprocess.Popen(step[1], cwd=REPO, env=_env_of(step, env), stdout=sink, stderr=subprocess.STDOUT)
                )
        codes = [process.wait() for process in running]
        failed = []
        for step, output, code in zip(stage, outputs, codes, strict=True):
            log.info("[Device Control] output of %s (exit %d):", _label(step), code)
            sys.stdout.flush()
            sys.stdout.buffer.write(output.read_bytes())
            sys.stdout.flush()
            if code != 0:
                failed.append(_label(step))
    return ", ".join(failed) or None


if __name__ == "__main__":
    sys.exit(main())
