"""Run every test tier: provision the runtime (ComfyUI, packages, Chromium), lint, then pytest: every tier on
ComfyUI 0.3.75, then the version checks (integration and browser tiers, ``tests/passes.py``) on 0.28.0 (a part of
them) and on 0.33.0, the newest, whose pass also runs the long reliability checks.

Each tier of each ComfyUI is a job, and two jobs run at a time (:func:`run_jobs`), as soon as what they need is
there and the machine's RAM holds them: the synthetic models first (every ComfyUI tier loads them), then the primary
integration tier's heavy modules, the longest job, and the other jobs beside it and after it: one tier's heavy
modules at a time, each tier's light modules (``tests/passes.py``) as a job that runs beside them, and the primary
tier's five families end to end as a job of their own. Each job's CPU time is logged when it ends.
The platforms users run are simulated (``core.devices.sim.platforms``): the core tier runs on this machine and again
under each simulated platform (Windows, 64 KiB-page arm64 Linux, macOS); the 0.33.0 pass runs its ComfyUI servers
under the Windows profile, so every streamed Move To GPU there goes through Windows' surface.

ComfyUI 0.28.0 and 0.33.0 come from source archives beside the repository (``../shared/comfyui/``); where one is
absent (a user's clone) its tiers are skipped with one line, and under ``CI=true`` that is a failure.

    python3 tools/run_tests.py            # everything; extra arguments go to pytest (each pass, one after another)
    python3 tools/run_tests.py --quick    # while working on a change: the core tier and one integration test
                                          # per node, on ComfyUI 0.3.75 only (under 10 minutes)
    python3 tools/run_tests.py --core     # the core tier alone, on this machine's OS (the platform matrix)

Every tier must run: a tier that cannot (no ComfyUI, no Chromium) fails instead of being skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import queue
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
from tools.runtime.provision import (
    NEWEST_TESTED,
    PRIMARY_VERSION,
    RELEASES,
    REPO,
    TESTED_VERSIONS,
    missing_source,
    provision,
)

log = logging.getLogger("device_control.tools")
#: Each pass ends with its slowest tests: where the time of a run goes, in every CI log.
DURATIONS = ("--durations=25",)
#: What a run from a fresh clone writes, in GB (du after one): the runtime in .runtime (packages and ComfyUI, 7),
#: the synthetic models in .runtime/fixtures (12, sparse files counted as what they use), and pytest's folder
#: (one module's files at a time: at most 0.9 seen).
DISK_NEEDED_GB = 21
ROOM = f"a run from a fresh clone needs about {DISK_NEEDED_GB} GB at its peak; make that much room and run again."


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
        "[Device Control] %.1f GB free on the disk; a run from a fresh clone needs about %d GB at its peak",
        disk_free_gb(),
        DISK_NEEDED_GB,
    )
    if options.core or options.quick:
        tests = ["tests/core"] if options.core else list(QUICK)
        job = Job.of([str(provision()), "-m", "pytest", *DURATIONS, *tests, *pytest_args], PRIMARY_VERSION)
        return finish(run_jobs([job], started), started)
    absent = {version: missing_source(version) for version in RELEASES if missing_source(version)}
    for version, reason in absent.items():
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            log.error("[Device Control] FAILED: %s; CI runs every ComfyUI we test.", reason)
            return 1
        log.warning("[Device Control] SKIPPED the ComfyUI %s tiers: %s.", version, reason)
    python = provision(browser=True, versions=tuple(v for v in RELEASES if v not in absent))
    groups = full_run(python, [v for v in TESTED_VERSIONS if v not in absent], pytest_args)
    code = next((code for code in (run_jobs(group, started) for group in groups) if code), 0)
    folders = sorted(SCRATCH.parent.glob(SCRATCH.name + "-*"))
    if code == 0:  # pytest keeps a --basetemp folder: a passing run's are removed, a failing run's kept to read
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
    elif folders:
        log.error("[Device Control] each pytest's files are kept under %s-*", SCRATCH)
    return finish(code, started)


def finish(code: int, started: float) -> int:
    """Say how the run ended and after how long; its exit status."""
    if code:
        log.error("[Device Control] the run failed after %.0f s", time.monotonic() - started)
        if disk_free_gb() < 2:
            log.error("[Device Control] The disk is full (%.1f GB free): %s", disk_free_gb(), ROOM)
    else:
        log.info("[Device Control] all test tiers passed in %.0f s", time.monotonic() - started)
    return code


#: The setting that chooses a simulated platform, and the platforms (``core.devices.sim.platforms``, which this
#: script does not import: it runs before the runtime that has torch exists; a core test keeps the two the same).
PLATFORM_ENV = "DEVICE_CONTROL_SIMULATE_PLATFORM"
PROFILES = ("windows", "linux-64k", "macos")
#: The setting that chooses an integration tier's light or heavy modules (``tests/passes.py``, which this script
#: does not import: it needs pytest).
MODULES_ENV = "DEVICE_CONTROL_MODULES"
#: The simulated platform each ComfyUI's pass runs its servers under (none: this machine's own).
PASS_PLATFORMS = {NEWEST_TESTED: "windows"}
#: Settings of torch's OpenMP threads for a job that runs beside another: wait without spinning, or compute on one.
PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}
ONE = {"OMP_NUM_THREADS": "1"}
#: Every job's torch puts its large host tensors on transparent huge pages (a Linux setting of torch's allocator,
#: ignored elsewhere; nothing of ours reads it). The tests load and drop models of gigabytes over and over, and on
#: 4 KiB pages test_split_model took 25-27 M page faults and 41-45 s of kernel time, with huge pages 3 M and 21-23 s:
#: about an eighth of its CPU (``docs/bench/ci_cpu_where.txt``).
HUGE_PAGES = {"THP_MEM_ALLOC_ENABLE": "1"}
#: The priority of a job that fills what the others leave of the cores (a niceness: higher is lower).
NICE = 10
#: The script each job runs under: the processes a job leaves behind (a browser's) are waited for, and their CPU
#: time counted in the job's figure.
REAP = REPO / "tools" / "runtime" / "reap.py"
#: The start of the name of each pytest's folder (``--basetemp``) in a whole run: one folder per tier and pass.
SCRATCH = Path(tempfile.gettempdir()) / f"device-control-{os.getpid()}"
#: How many jobs run at once: the CI machine's two cores (each job's ComfyUI servers and browser use more than one
#: at times, and wait on each other at others).
LANES = 2
#: The primary integration tier's five families end to end: a job of its own (see WEIGHTS).
FAMILIES_MODULE = "tests/integration/test_families.py"
#: What each kind of job weighs for the scheduler, by tier and pass: (minutes, most RAM in GiB).
#:
#: Minutes: the last fresh-clone run, each job beside another (``docs/bench/ci_fresh_clone_3872e0f.txt``), and for
#: the modules it ran apart then (families and splits, about 5 minutes alone since the SDXL fixture is SDXL's class
#: at Segmind Vega's depth) their time alone (the splits now among the heavy modules, and a loader filling a simulated
#: GPU, half a minute, among the light ones); the primary pass runs every test, the newest the version checks and the
#: long checks, a middle one a part of them.
#:
#: RAM: ``ps`` and ``free`` every 5 s while they ran, on the 24 GB CI machine, and the RSS of pytest's process tree
#: every 0.5 s (``docs/bench/ci_module_ram.txt``). The families module (9.1 GiB) fits beside a light job, a browser
#: tier or the middle pass's heavy modules (9.8 GiB), not beside another heavy job. Two
#: integration tiers side by side (their servers held 4-9 GB, pytest 1-4 GB) left as little as 2.7 GiB available,
#: their modules that hold several full-size models at once taking turns (``tests/server_pool.py``'s RAM lock), and a
#: module that holds more than its lock says (the hook LoRA's stock graph: 11.7 GB in its server) was killed for
#: memory beside the other tier. So an integration tier's heavy modules count 15.5 GiB (the most seen: 13.6) and two
#: of them never run at once; its light modules (``tests/passes.py``: at most about 7.5 GiB) are a job that runs
#: beside them, in the third of the two cores a tier alone left idle. More, and the page cache goes and the machine
#: stalls on reads.
WEIGHTS: dict[str | tuple[str, str], tuple[float, float]] = {
    "fixtures": (0.9, 6.0),
    "core": (0.9, 2.0),
    "families": (3.0, 9.5),
    ("integration", "primary"): (20.6, 15.5),
    ("integration", "newest"): (14.8, 15.5),
    ("integration", "middle"): (2.9, 10.0),
    ("light", "primary"): (8.1, 7.5),
    ("light", "newest"): (6.3, 7.5),
    ("light", "middle"): (1.9, 7.5),
    ("browser", "primary"): (8.2, 4.5),
    ("browser", "newest"): (4.8, 4.5),
    ("browser", "middle"): (2.8, 4.5),
}


def weights(kind: str | tuple[str, str]) -> dict[str, float]:
    """The scheduler's weights of a kind of job (:data:`WEIGHTS`), as :meth:`Job.of` takes them."""
    minutes, ram_gib = WEIGHTS[kind]
    return {"minutes": minutes, "ram_gib": ram_gib}


@dataclass(frozen=True)
class Job:
    """One command of a run, with its settings, and what the scheduler weighs: how long it is expected to take
    (minutes), the most RAM it holds (GiB), the labels of the jobs it must follow, and how much lower its CPU
    priority is than the others' (``nice``: a job that only fills what the others leave of the cores)."""

    label: str
    settings: dict[str, str]
    command: tuple[str, ...]
    minutes: float = 0.5
    ram_gib: float = 0.5
    after: tuple[str, ...] = ()
    nice: int = 0

    @classmethod
    def of(cls, command: list[str], version: str = "", *, env: dict[str, str] | None = None, **weights: Any) -> Job:
        """``command`` on ComfyUI ``version`` (none: no ComfyUI), with settings ``env`` and the scheduler's
        ``weights`` (``minutes``, ``ram_gib``, ``after``, ``nice``)."""
        env = env or {}
        settings = {**({"DEVICE_CONTROL_COMFYUI": version} if version else {}), **env}
        label = " ".join(command[command.index("-m") + 1 :]) + (f" (ComfyUI {version})" if version else "")
        label += f" (simulated {env[PLATFORM_ENV]})" if PLATFORM_ENV in env else ""
        label += f" ({env[MODULES_ENV]} modules)" if MODULES_ENV in env else ""
        return cls(label, settings, tuple(command), **weights)


def full_run(python: Path, versions: list[str], pytest_args: list[str]) -> list[list[Job]]:
    """The jobs of a whole run on ``versions`` (the primary first), in groups run one after the other: the lint
    first (the commonest failure, found in seconds), then everything else."""
    pytest = [str(python), "-m", "pytest", *DURATIONS]
    ruff = [str(python), "-m", "ruff"]
    lint = [Job.of([*ruff, "check", "."]), Job.of([*ruff, "format", "--check", "."])]
    primary = versions[0]
    if pytest_args:  # what was asked for, in each pass, one pass after the other
        passes: list[Job] = []
        for version in versions:
            after = (passes[-1].label,) if passes else ()
            most = WEIGHTS[("integration", "primary")][1]
            passes.append(Job.of([*pytest, *pytest_args], version, after=after, ram_gib=most))
        return [lint, passes]
    # The core tier (it does not import ComfyUI) and the synthetic models need nothing but the runtime; the tiers
    # that run ComfyUI need the models. The core tier runs on this machine and again under each simulated platform.
    # Each pytest has a folder of its own: two in one folder would remove each other's.
    # Torch's threads that spin while they wait for work take the core another process computes on: ComfyUI's tiers
    # wait passively, and the core tier computes on one thread, at a lower priority, in what the others leave of the
    # two cores (its tests have no deadline; the browser's have). Measured side by side: docs/bench/ci_threads.txt.
    fixtures = Job.of([str(python), "-m", "tools.fixtures.make"], primary, **weights("fixtures"))
    jobs = [fixtures]
    for name in (None, *PROFILES):
        command = [*pytest, "tests/core", f"--basetemp={SCRATCH}-{name or 'core'}"]
        env = {**({PLATFORM_ENV: name} if name else {}), **ONE}
        jobs.append(Job.of(command, primary, env=env, **weights("core"), nice=NICE))
    for version in versions:
        kind = "primary" if version == primary else "newest" if version == versions[-1] else "middle"
        env = {**({PLATFORM_ENV: PASS_PLATFORMS[version]} if version in PASS_PLATFORMS else {}), **PASSIVE}
        after = (fixtures.label,)
        # The integration tier's light modules (``tests/passes.py``) are a job of their own, beside the others.
        command = [*pytest, "tests/integration", f"--basetemp={SCRATCH}-{version}-light"]
        light = {**env, MODULES_ENV: "light"}
        jobs.append(Job.of(command, version, env=light, **weights(("light", kind)), after=after))
        for tier in ("integration", "browser"):
            paths = [f"tests/{tier}"]
            own = {**env, MODULES_ENV: "heavy"} if tier == "integration" else env
            if (tier, kind) == ("integration", "primary"):  # the families apart (see WEIGHTS)
                paths.append(f"--ignore={FAMILIES_MODULE}")
                command = [*pytest, FAMILIES_MODULE, f"--basetemp={SCRATCH}-{version}-families"]
                jobs.append(Job.of(command, version, env=env, **weights("families"), after=after))
            command = [*pytest, *paths, f"--basetemp={SCRATCH}-{version}-{tier}"]
            jobs.append(Job.of(command, version, env=own, **weights((tier, kind)), after=after))
    return [lint, jobs]


def machine_ram_gib() -> float:
    """This machine's RAM, in GiB (where the OS does not say: 16, so that no two integration tiers run at once)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    except (AttributeError, ValueError, OSError):
        return 16.0


def order(jobs: list[Job]) -> list[Job]:
    """The jobs by their critical path, the longest first: a job's own minutes and the longest chain of jobs that
    wait for it. (The models come first, as every ComfyUI tier waits for them; the primary integration tier, the
    longest, then starts as soon as they are made; the short jobs fill the other lane.)"""
    by_label = {job.label: job for job in jobs}
    waiting = {job.label: [j for j in jobs if job.label in j.after] for job in jobs}
    rank: dict[str, float] = {}

    def path(label: str) -> float:
        if label not in rank:
            rank[label] = by_label[label].minutes + max((path(j.label) for j in waiting[label]), default=0.0)
        return rank[label]

    return sorted(jobs, key=lambda job: -path(job.label))


def runnable(job: Job, done: set[str], running: list[Job], ram_gib: float) -> bool:
    """Whether ``job`` may start now: the jobs it follows are done, a lane is free, and the RAM the running jobs hold
    leaves room for it (a job alone always starts)."""
    if not set(job.after) <= done or len(running) >= LANES:
        return False
    return not running or sum(j.ram_gib for j in running) + job.ram_gib <= ram_gib


def run_jobs(jobs: list[Job], started: float, ram_gib: float | None = None) -> int:
    """Run the jobs, at most :data:`LANES` at once, each as soon as it may (:func:`runnable`), in the order of their
    critical paths; after a job fails, none starts. Each job's output is printed whole when it ends."""
    ram_gib = machine_ram_gib() if ram_gib is None else ram_gib
    env = {**os.environ, **HUGE_PAGES, "DEVICE_CONTROL_REQUIRE_ALL_TIERS": "1"}
    pending, running, done, failed = order(jobs), [], set(), []
    index = {job.label: number for number, job in enumerate(pending)}
    ended: queue.Queue[tuple[Job, int, Path | None, str]] = queue.Queue()
    with tempfile.TemporaryDirectory(prefix="device-control-jobs-") as folder:
        while pending or running:
            for job in list(pending):
                if not failed and runnable(job, done, running, ram_gib):
                    pending.remove(job)
                    running.append(job)
                    # A job run alone prints as it goes; beside others, each job's output is kept until it ends.
                    output = Path(folder) / f"{index[job.label]}.log" if len(jobs) > 1 else None
                    log.info("[Device Control] $ %s (after %.0f s)", job.label, time.monotonic() - started)
                    threading.Thread(target=_run_job, args=(job, env, output, ended), daemon=True).start()
            if not running:  # a job failed and the rest will not start, or none can start (a missing dependency)
                break
            job, code, output, cpu = ended.get()
            running.remove(job)
            took = time.monotonic() - started
            log.info("[Device Control] %s ended (exit %d, after %.0f s%s)", job.label, code, took, cpu)
            if output is not None:
                sys.stdout.flush()
                sys.stdout.buffer.write(output.read_bytes())
                sys.stdout.flush()
            if code:
                failed.append(job.label)
            else:
                done.add(job.label)
    for label in failed:
        log.error("[Device Control] FAILED: %s", label)
    if pending and not failed:
        log.error("[Device Control] FAILED: never started: %s", ", ".join(job.label for job in pending))
    return 1 if failed or pending else 0


def _run_job(job: Job, env: dict[str, str], output: Path | None, ended: queue.Queue) -> None:
    """Run ``job``'s command, its output to ``output`` (``None``: straight through), at its priority where the OS
    has priorities; report its exit status and CPU time."""
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(open(output, "wb")) if output is not None else None
        # Through REAP: what the command leaves behind is waited for, so the CPU figure is the job's.
        command = [sys.executable, str(REAP), *(["--nice", str(job.nice)] if job.nice else [])]
        process = subprocess.Popen(
            [*command, *job.command], cwd=REPO, env={**env, **job.settings}, stdout=sink, stderr=subprocess.STDOUT
        )
        code, cpu = _wait(process)
    ended.put((job, code, output, cpu))


def _wait(process: subprocess.Popen) -> tuple[int, str]:
    """Wait for ``process``; its exit status and, where the OS says (``wait4``), the CPU time it and the processes
    it waited for took: a run on two cores is as long as its CPU work over two, whatever runs side by side."""
    if not hasattr(os, "wait4"):
        return process.wait(), ""
    _pid, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    return process.returncode, f"; CPU {usage.ru_utime:.0f} s user, {usage.ru_stime:.0f} s kernel"


if __name__ == "__main__":
    sys.exit(main())
