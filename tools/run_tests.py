"""Run every test tier: provision the runtime (ComfyUI, packages, Chromium), lint, then pytest: every tier on
ComfyUI 0.3.75, then the version checks (integration and browser tiers, ``tests/passes.py``) on 0.28.0 (a part of
them) and on 0.33.0, the newest, whose pass also runs the long reliability checks.

In each ComfyUI's pass the integration and browser tiers run side by side, each in a pytest of its own. The
platforms users run are simulated (``core.devices.sim.platforms``): the core tier runs on this machine and again
under each simulated platform (Windows, 64 KiB-page arm64 Linux, macOS), after the browser tier of the 0.3.75 pass;
the 0.33.0 pass runs its ComfyUI servers under the Windows profile, so every streamed Move To GPU there goes through
Windows' surface.

ComfyUI 0.28.0 and 0.33.0 come from source archives beside the repository (``../shared/comfyui/``); where one is
absent (a user's clone) its tiers are skipped with one line, and under ``CI=true`` that is a failure.

    python3 tools/run_tests.py            # everything; extra arguments go to pytest (each pass)
    python3 tools/run_tests.py --quick    # while working on a change: the core tier and one integration test
                                          # per node, on ComfyUI 0.3.75 only (under 10 minutes)
    python3 tools/run_tests.py --core     # the core tier alone, on this machine's OS (the platform matrix)

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
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from any folder

from tests.quick import QUICK
from tools.runtime import NEWEST_TESTED, PRIMARY_VERSION, RELEASES, REPO, TESTED_VERSIONS, missing_source, provision

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
    parser.add_argument(
        "--core",
        action="store_true",
        help="the core tier alone, on this machine as it is (no simulated platform): what the Windows, macOS and "
        "Linux runners of the platform matrix (.github/workflows/platforms.yml) run",
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
    if options.core:
        core = Step.one([str(provision()), "-m", "pytest", *DURATIONS, "tests/core", *pytest_args], PRIMARY_VERSION)
        return run_stages([[core]], started)
    if options.quick:
        python = provision()
        quick = Step.one([str(python), "-m", "pytest", *DURATIONS, *QUICK, *pytest_args], PRIMARY_VERSION)
        return run_stages([[quick]], started)
    absent = {version: missing_source(version) for version in RELEASES if missing_source(version)}
    for version, reason in absent.items():
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            log.error("[Device Control] FAILED: %s; CI runs every ComfyUI we test.", reason)
            return 1
        log.warning("[Device Control] SKIPPED the ComfyUI %s tiers: %s.", version, reason)
    python = provision(browser=True, versions=tuple(v for v in RELEASES if v not in absent))
    code = run_stages(full_run(python, [v for v in TESTED_VERSIONS if v not in absent], pytest_args), started)
    folders = sorted(SCRATCH.parent.glob(SCRATCH.name + "-*"))
    if code == 0:  # pytest keeps a --basetemp folder: a passing run's are removed, a failing run's kept to read
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
    elif folders:
        log.error("[Device Control] each pytest's files are kept under %s-*", SCRATCH)
    return code


#: The setting that chooses a simulated platform, and the platforms (``core.devices.sim.platforms``, which this
#: script does not import: it runs before the runtime that has torch exists; a core test keeps the two the same).
PLATFORM_ENV = "DEVICE_CONTROL_SIMULATE_PLATFORM"
PROFILES = ("windows", "linux-64k", "macos")
#: The simulated platform each ComfyUI's pass runs its servers under (none: this machine's own).
PASS_PLATFORMS = {NEWEST_TESTED: "windows"}
#: Settings of torch's OpenMP threads for a step that runs beside another: wait without spinning, or compute on one.
PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}
ONE = {"OMP_NUM_THREADS": "1"}
#: The start of the name of each pytest's folder (``--basetemp``) in a whole run: one folder per tier and pass.
SCRATCH = Path(tempfile.gettempdir()) / f"device-control-{os.getpid()}"


@dataclass(frozen=True)
class Step:
    """Commands run one after the other (each with settings of its own), under a label; the steps of a stage run
    side by side."""

    label: str
    commands: tuple[tuple[dict[str, str], tuple[str, ...]], ...]

    @classmethod
    def one(cls, command: list[str], version: str = "", **env: str) -> Step:
        """One command, on ComfyUI ``version`` (none: no ComfyUI), with settings ``env``."""
        settings = {**({"DEVICE_CONTROL_COMFYUI": version} if version else {}), **env}
        label = " ".join(command[command.index("-m") + 1 :]) + (f" (ComfyUI {version})" if version else "")
        label += f" (simulated {env[PLATFORM_ENV]})" if PLATFORM_ENV in env else ""
        return cls(label, ((settings, tuple(command)),))


def full_run(python: Path, versions: list[str], pytest_args: list[str]) -> list[list[Step]]:
    """The stages of a whole run on ``versions`` (the primary first)."""
    pytest = [str(python), "-m", "pytest", *DURATIONS]
    ruff = [str(python), "-m", "ruff"]
    lint = [Step.one([*ruff, "check", "."]), Step.one([*ruff, "format", "--check", "."])]
    primary = versions[0]
    if pytest_args:  # what was asked for, in each pass
        return [[step] for step in lint] + [[Step.one([*pytest, *pytest_args], version)] for version in versions]
    # The lint, the core tier (it does not import ComfyUI) and the synthetic models the other tiers load run side
    # by side (they take little memory); then the tiers that run ComfyUI, on each version in turn.
    fixtures = Step.one([str(python), "-m", "tools.make_fixtures"], primary)
    stages = [[*lint, Step.one([*pytest, "tests/core"], primary), fixtures]]
    # A pass's integration tier alone leaves a fifth to a quarter of a 2-core machine idle (its ComfyUI servers wait
    # on each other and on the disk); the browser tier is light (the starter's models, one server at a time), so it
    # runs beside it, and on the primary version the core tier under each simulated platform follows it in the same
    # lane. Each pytest has a folder of its own: two in one folder would remove each other's.
    # Two processes side by side on two cores: torch's threads that spin while they wait for work take the core the
    # other process computes on. ComfyUI's tiers wait passively; the core tier beside them computes on one thread
    # (its models are small). Measured side by side: docs/bench/ci_threads.txt.
    for version in versions:
        platform = {PLATFORM_ENV: PASS_PLATFORMS[version]} if version in PASS_PLATFORMS else {}
        integration, browser = (
            Step.one(
                [*pytest, f"tests/{tier}", f"--basetemp={SCRATCH}-{version}-{tier}"], version, **platform, **PASSIVE
            )
            for tier in ("integration", "browser")
        )
        if version == primary:
            profiles = [
                Step.one(
                    [*pytest, "tests/core", f"--basetemp={SCRATCH}-{name}"], primary, **{PLATFORM_ENV: name}, **ONE
                )
                for name in PROFILES
            ]
            browser = Step(
                f"{browser.label}, then the core tier under " + ", ".join(PROFILES),
                browser.commands + tuple(c for step in profiles for c in step.commands),
            )
        stages.append([integration, browser])
    return stages


def run_stages(stages: list[list[Step]], started: float) -> int:
    """Run each stage in turn, the steps of a stage side by side; stop after the first stage with a step that
    fails. A stage of several steps prints each one's output when it ends, whole, in the order given."""
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


def _commands(step: Step, env: dict[str, str], **output: Any) -> int:
    """Run ``step``'s commands in turn until one fails; its exit status (0 when all passed)."""
    for settings, command in step.commands:
        done = subprocess.run(list(command), cwd=REPO, env={**env, **settings}, check=False, **output)
        if done.returncode != 0:
            return done.returncode
    return 0


def _run_one(step: Step, env: dict[str, str]) -> str | None:
    """Run a step with its output going straight through; its label if it failed, else ``None``."""
    log.info("[Device Control] $ %s", step.label)
    return step.label if _commands(step, env) != 0 else None


def _run_side_by_side(stage: list[Step], env: dict[str, str]) -> str | None:
    """Start every step of ``stage`` at once (each in a thread of its own: a step may be several commands in turn),
    then print each one's output in turn; the labels of those that failed, or ``None``."""
    with tempfile.TemporaryDirectory(prefix="device-control-steps-") as folder:
        outputs = [Path(folder) / f"{index}.log" for index in range(len(stage))]
        codes: dict[int, int] = {}

        def run(index: int, step: Step) -> None:
            with open(outputs[index], "wb") as sink:
                codes[index] = _commands(step, env, stdout=sink, stderr=subprocess.STDOUT)

        threads = [threading.Thread(target=run, args=(index, step)) for index, step in enumerate(stage)]
        for step, thread in zip(stage, threads, strict=True):
            log.info("[Device Control] $ %s (side by side)", step.label)
            thread.start()
        for thread in threads:
            thread.join()
        failed = []
        for index, step in enumerate(stage):
            log.info("[Device Control] output of %s (exit %d):", step.label, codes[index])
            sys.stdout.flush()
            sys.stdout.buffer.write(outputs[index].read_bytes())
            sys.stdout.flush()
            if codes[index] != 0:
                failed.append(step.label)
    return ", ".join(failed) or None


if __name__ == "__main__":
    sys.exit(main())
