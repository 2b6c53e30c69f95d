"""The repository's own commands answer ``--help`` with how to use them, and start nothing."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_run_tests_help_prints_usage_and_provisions_nothing():
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "tools/run_tests.py", "--help"], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0 and done.stdout.startswith("usage: python3 tools/run_tests.py")
    assert "--soak-cycles" in done.stdout and "Any other argument goes to pytest" in done.stdout
    assert "pip" not in done.stdout + done.stderr and time.monotonic() - started < 10


def test_the_surface_check_names_a_missing_symbol_and_fails(tmp_path):
    """On a ComfyUI tree that lacks what the pack uses, the command says which symbols and exits 1."""
    (tmp_path / "comfy").mkdir()
    (tmp_path / "comfy" / "model_management.py").write_text("def load_models_gpu(models): ...\nvram_state = 0\n")
    (tmp_path / "comfyui_version.py").write_text('__version__ = "9.9.9"\n')
    done = subprocess.run(
        [sys.executable, "-m", "tools.runtime.surface_check", str(tmp_path)], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 1 and "(version 9.9.9)" in done.stdout
    assert "comfy.model_management.load_models_gpu" in done.stdout and "MISSING" in done.stdout
    present = {line.split()[0] for line in done.stdout.splitlines() if line.endswith("  present")}
    expected = {"comfy.model_management.load_models_gpu", "comfy.model_management.vram_state"}
    assert present == expected | {"comfyui_version.__version__"}
    assert "comfy.memory_management.aimdo_enabled" in done.stdout and "absent (optional" in done.stdout


def test_the_surface_check_refuses_a_folder_that_is_not_comfyui(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tools.runtime.surface_check", str(tmp_path)], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 2 and "is not a ComfyUI folder" in done.stderr


def test_the_split_benchmark_table_gives_medians_and_the_floor():
    from tools.bench.split import ROWS, table

    def run(compute: float) -> dict:
        rows = {name: {"step_s": 2 * compute, "moved": 2 * 1024**3, "transfer_s": 1.0} for name, *_ in ROWS}
        rows[ROWS[0][0]] = {"step_s": compute, "moved": 0, "transfer_s": 0.0}
        return {"links": {"7GB/s": rows}}

    text = table([run(3.0), run(4.0), run(5.0)])
    assert "| 7GB/s | one device, everything resident | 0.00 GiB | 0.00 s | 4.00 s (3.00-5.00) | 4.00 s |" in text
    assert "| 7GB/s | pipeline gpu:0=50%, gpu:1=* | 2.00 GiB | 1.00 s | 8.00 s (6.00-10.00) | 4.00 s | 2.00x" in text


def test_hollow_keeps_every_byte_and_gives_back_the_disk_of_zero_blocks(tmp_path):
    """The UMT5 fixture's unused embedding rows take no disk: the file reads back the same, leading, inner and
    trailing zeros included."""
    from tools.fixtures.files import hollow

    zeros = bytes(8 << 20)
    for name, data in {"inner": os.urandom(5000) + zeros + os.urandom(100), "ends": zeros + b"x" + zeros}.items():
        path = tmp_path / name
        path.write_bytes(data)
        assert hollow(path) == path and path.read_bytes() == data
        assert path.stat().st_blocks * 512 < 1 << 20, name  # on a file system with holes (ext4, xfs, tmpfs)


def test_the_run_simulates_every_platform_the_pack_has():
    from core.devices.sim import platforms
    from tools import run_tests

    assert (run_tests.PLATFORM_ENV, run_tests.PROFILES) == (platforms.PLATFORM_ENV, platforms.PROFILES)
    assert run_tests.PASS_PLATFORMS == {"0.33.0": "windows"}


def test_a_run_is_every_tier_on_every_version_each_in_a_folder_of_its_own():
    """The lint first; then the core tier on this machine and under each simulated platform, and each ComfyUI's
    integration and browser tiers after the models; no two pytests share a folder (each would remove the other's);
    the newest ComfyUI's servers run under the simulated Windows."""
    from tests import passes
    from tools import run_tests

    lint, jobs = run_tests.full_run(Path("python"), ["0.3.75", "0.28.0", "0.33.0"], [])
    assert [job.command[3:] for job in lint] == [("check", "."), ("format", "--check", ".")]
    folders = [arg for job in jobs for arg in job.command if arg.startswith("--basetemp=")]
    # Each ComfyUI's integration, light modules' and browser jobs, the families' job, the core tier's
    assert len(folders) == len(set(folders)) == 3 * 3 + 1 + 1 + len(run_tests.PROFILES)
    fixtures = next(job for job in jobs if "tools.fixtures.make" in job.command)
    tiers = {
        (job.settings["DEVICE_CONTROL_COMFYUI"], job.command[4], job.settings.get(run_tests.MODULES_ENV)): job
        for job in jobs
        if "tests/core" not in job.command and job is not fixtures
    }
    families = tiers.pop(("0.3.75", run_tests.FAMILIES_MODULE, None))
    versions = ("0.3.75", "0.28.0", "0.33.0")
    assert set(tiers) == {
        *((v, "tests/integration", part) for v in versions for part in ("light", "heavy")),
        *((v, "tests/browser", None) for v in versions),
    }
    # The primary integration tier is every module once: the families in their job, the light ones in theirs
    # (tests/passes.py), the rest in the tier's.
    assert run_tests.MODULES_ENV == passes.MODULES_ENV
    assert all(Path(REPO, "tests/integration", f"{module}.py").is_file() for module in passes.LIGHT_MODULES)
    assert Path(run_tests.FAMILIES_MODULE).stem not in passes.LIGHT_MODULES
    rest = tiers["0.3.75", "tests/integration", "heavy"].command
    assert [f"--ignore={run_tests.FAMILIES_MODULE}"] == [a for a in rest if a.startswith("--ignore=")]
    assert [a for a in families.command if a.startswith("tests/")] == [run_tests.FAMILIES_MODULE]
    assert Path(REPO, run_tests.FAMILIES_MODULE).is_file()
    assert families.after == (fixtures.label,)
    assert all(job.after == (fixtures.label,) for job in tiers.values())
    simulated = [job.settings.get(run_tests.PLATFORM_ENV) for job in jobs if "tests/core" in job.command]
    assert simulated == [None, *run_tests.PROFILES]
    newest = {job.settings.get(run_tests.PLATFORM_ENV) for (version, *_), job in tiers.items() if version == "0.33.0"}
    assert newest == {"windows"}


def test_an_integration_tier_is_its_light_modules_and_its_heavy_ones_each_module_in_one(monkeypatch):
    """``DEVICE_CONTROL_MODULES`` collects a tier's light modules or the others; unset, every module; the
    folders and helpers are always collected."""
    from tests import passes

    modules = sorted(Path(REPO, "tests/integration").glob("test_*.py"))
    chosen = {}
    for part in ("light", "heavy"):
        monkeypatch.setenv(passes.MODULES_ENV, part)
        chosen[part] = {module.stem for module in modules if passes.collects(module)}
        assert passes.collects(Path(REPO, "tests/integration/conftest.py"))
        assert passes.collects(Path(REPO, "tests/integration/executions"))
    assert chosen["light"] == passes.LIGHT_MODULES and not chosen["light"] & chosen["heavy"]
    assert chosen["light"] | chosen["heavy"] == {module.stem for module in modules}
    monkeypatch.delenv(passes.MODULES_ENV)
    assert all(passes.collects(module) for module in modules)


def test_jobs_beside_another_do_not_spin_torch_threads_and_the_core_tier_fills_what_is_left():
    """ComfyUI's tiers wait passively; the core tier computes on one thread at a lower priority (docs/bench/
    ci_threads.txt: spinning threads took the other tier's core)."""
    from tools import run_tests

    _, jobs = run_tests.full_run(Path("python"), ["0.3.75", "0.33.0"], [])
    for job in jobs:
        if "tests/core" in job.command:
            assert run_tests.ONE.items() <= job.settings.items() and job.nice == run_tests.NICE, job.label
        elif "pytest" in job.command:
            assert run_tests.PASSIVE.items() <= job.settings.items() and job.nice == 0, job.label


def test_the_models_come_first_then_the_longest_chain_and_one_integration_tier_at_a_time():
    """On a 24 GB machine: the models first (every ComfyUI tier waits for them), the primary integration tier as
    soon as they are made, the core tier beside the models; one integration tier's heavy modules at a time, a tier's
    light modules beside any of them; the families' job (9.1 GiB) beside a light or browser job or the middle
    ComfyUI's heavy modules, not beside the others' heavy modules."""
    from tools import run_tests

    _, jobs = run_tests.full_run(Path("python"), ["0.3.75", "0.28.0", "0.33.0"], [])
    ordered = run_tests.order(jobs)
    assert "tools.fixtures.make" in ordered[0].command
    assert ordered[1].command[4] == "tests/integration" and ordered[1].settings["DEVICE_CONTROL_COMFYUI"] == "0.3.75"
    assert ordered[1].settings[run_tests.MODULES_ENV] == "heavy"
    by_part = {"light": [], "heavy": []}
    for job in jobs:
        if run_tests.MODULES_ENV in job.settings:
            by_part[job.settings[run_tests.MODULES_ENV]].append(job)
    integration, light = by_part["heavy"], by_part["light"]
    core = next(job for job in jobs if "tests/core" in job.command)
    assert run_tests.runnable(core, set(), [ordered[0]], 23.5)
    assert not run_tests.runnable(integration[0], set(), [], 23.5)  # the models are not made yet
    done = {ordered[0].label}
    assert run_tests.runnable(integration[0], done, [], 23.5)
    assert not any(run_tests.runnable(other, done, [integration[0]], 23.5) for other in integration[1:])
    assert all(run_tests.runnable(job, done, [heavy], 23.5) for job in light for heavy in integration)
    assert run_tests.runnable(integration[1], done, [integration[0]], 64.0)  # a machine with room for two
    assert not run_tests.runnable(core, done, integration[:2], 64.0)  # two lanes
    families = next(job for job in jobs if run_tests.FAMILIES_MODULE in job.command)
    middle = [job for job in integration if job.settings["DEVICE_CONTROL_COMFYUI"] == "0.28.0"]
    browser = [job for job in jobs if "tests/browser" in job.command]
    assert all(run_tests.runnable(families, done, [job], 23.5) for job in light + browser + middle)
    assert not any(run_tests.runnable(families, done, [job], 23.5) for job in integration if job not in middle)
    assert run_tests.runnable(families, done, [integration[0]], 64.0)  # a machine with room for both


def test_the_scheduler_runs_what_it_may_side_by_side_and_starts_nothing_after_a_failure(tmp_path):
    """Real processes: two at a time, a job after the one it follows, none started after a failure, and the
    run's status is the failure's."""
    from tools import run_tests

    def job(name: str, seconds: float, code: int = 0, after: tuple[str, ...] = ()) -> run_tests.Job:
        script = f"import pathlib,time; time.sleep({seconds}); pathlib.Path(r'{tmp_path}', '{name}').touch()"
        script += f"; raise SystemExit({code})"
        return run_tests.Job(name, {}, (sys.executable, "-c", script), minutes=seconds, after=after)

    started = time.monotonic()
    assert run_tests.run_jobs([job("a", 1.0), job("b", 1.0), job("c", 0.1, after=("a",))], started) == 0
    assert {p.name for p in tmp_path.iterdir()} == {"a", "b", "c"} and time.monotonic() - started < 2.8
    for made in tmp_path.iterdir():
        made.unlink()
    assert run_tests.run_jobs([job("bad", 0.1, code=3), job("d", 0.1, after=("bad",)), job("e", 2.0)], started) == 1
    assert not (tmp_path / "d").exists()


@pytest.mark.skipif(importlib.util.find_spec("fcntl") is None, reason="no flock here: the tiers run one at a time")
def test_a_module_that_holds_several_models_waits_for_the_other_tiers_modules(tmp_path):
    """Two integration tiers side by side (tools/run_tests.py): a module that holds several full-size models
    (``HOLDS_MODELS``) starts only once the other process's module, which shares the RAM lock, has ended; modules
    that share it run at once."""
    from tests.server_pool import machine_ram

    lock, mark = tmp_path / "ram.lock", tmp_path / "shared-ended"
    holder = (
        f"import pathlib, time; from tests.server_pool import machine_ram\n"
        f"with machine_ram(False, pathlib.Path(r'{lock}')):\n"
        f"    pathlib.Path(r'{tmp_path}', 'shared-holds').touch(); time.sleep(1.5)\n"
        f"    pathlib.Path(r'{mark}').touch()\n"
    )
    other = subprocess.Popen([sys.executable, "-c", holder], cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "shared-holds").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        with machine_ram(False, lock):
            assert not mark.exists()  # shared beside shared
        with machine_ram(True, lock):
            assert mark.exists()  # alone: after the other module ended
    finally:
        assert other.wait(timeout=30) == 0


def test_a_test_server_drops_cached_models_only_when_the_machine_is_nearly_out_of_ram():
    """ComfyUI 0.28 and later drop cached outputs (loaded models first) below 10 % of RAM available, which two test
    jobs side by side reach on the 24 GB CI machine: the tests' servers lower that headroom; 0.3.x, which caches
    classically unless asked, is started as it is."""
    from tests.conftest import CACHE_HEADROOM_GIB
    from tools.runtime.provision import PRIMARY_VERSION, TESTED_VERSIONS, comfyui_dir
    from tools.runtime.server import cache_headroom_args

    for version in (version for version in TESTED_VERSIONS if comfyui_dir(version).is_dir()):
        expected = () if version.startswith("0.3.") else ("--cache-ram", "0.5")
        assert cache_headroom_args(CACHE_HEADROOM_GIB, version) == expected, version
    assert cache_headroom_args(CACHE_HEADROOM_GIB, PRIMARY_VERSION) == ()


#: What sits at the top of tools/: README's two commands; everything else lives in a package of its concern.
TOP_LEVEL_TOOLS = {"__init__.py", "demo.py", "run_tests.py"}


def test_tools_sit_in_packages_by_concern_each_saying_what_it_is_for_and_who_runs_it():
    import ast

    tools = REPO / "tools"
    assert {p.name for p in tools.glob("*.py")} == TOP_LEVEL_TOOLS
    packages = [p for p in tools.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))]
    assert {p.name for p in packages} >= {"bench", "fixtures", "gpu", "runtime", "templates"}
    for package in packages:
        init = package / "__init__.py"
        assert init.exists(), f"{package} holds tools but is no package"
        docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert " run" in docstring, f"{init}'s docstring says neither what the package is for nor who runs it"
        for module in package.glob("*.py"):
            assert ast.get_docstring(ast.parse(module.read_text())), f"{module} has no docstring"


def test_the_runtime_installs_every_pin_once_and_leaves_torchs_compiler_backend_out(tmp_path):
    from tools.runtime.provision import LEFT_OUT, PINS, REPO, pinned_packages

    first = tmp_path / "first.txt"
    first.write_text("# a comment\ntorch==2.14.1\nFoo_Bar==1.0  # why\n")
    second = tmp_path / "second.txt"
    second.write_text("foo-bar==2.0\ntriton==3.8.0\nsafetensors>=0.4.2\n")
    assert pinned_packages(first, second) == ["torch==2.14.1", "Foo_Bar==1.0", "safetensors>=0.4.2"]
    pins = pinned_packages(PINS / "requirements.txt", PINS / "constraints.txt", REPO / "requirements.txt")
    assert {"triton"} == LEFT_OUT and all("==" in pin for pin in pins)  # the pack's own ranges are pinned too
    assert {"torch==2.14.1", "safetensors==0.8.0", "psutil==7.2.2"} <= set(pins)


#: A command that ends at once and leaves a process of its own behind, which goes on: as a browser's helpers
#: outlive the process that started them.
LEAVES_A_PROCESS = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', {child!r}])"
#: Left behind, it works for two seconds of CPU, or sleeps after writing its pid where ``LEFT_PID`` says.
WORKS = "import time\nend = time.process_time() + 2.0\nwhile time.process_time() < end: pass"
SLEEPS = "import os, pathlib, time; pathlib.Path(os.environ['LEFT_PID']).write_text(str(os.getpid())); time.sleep(600)"


def _cpu_seconds(figure: str) -> float:
    """The seconds of a job's CPU figure ("; CPU 1 s user, 1 s kernel"), user and kernel together."""
    user, kernel = figure.split("CPU ")[1].split(", ")
    return float(user.split()[0]) + float(kernel.split()[0])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="subreapers are Linux's")
def test_a_jobs_cpu_counts_the_processes_it_left_behind():
    """A job's CPU figure (``wait4``) counts what its command left behind, which ran on when its parent ended:
    through ``tools/runtime/reap.py``, not without it."""
    import queue as queues

    from tools import run_tests

    command = (sys.executable, "-c", LEAVES_A_PROCESS.format(child=WORKS))
    assert _cpu_seconds(run_tests._wait(subprocess.Popen(command))[1]) < 0.5  # alone: the process left is not counted
    ended: queues.Queue = queues.Queue()
    run_tests._run_job(run_tests.Job("leaves", {}, command), dict(os.environ), None, ended)
    _job, code, _output, cpu = ended.get(timeout=60)
    assert code == 0 and _cpu_seconds(cpu) >= 1.5, cpu


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="subreapers are Linux's")
def test_a_process_a_job_left_running_is_killed_when_the_job_ends(tmp_path):
    """What a job leaves running (a server or browser it failed to stop) is killed once the job has ended and given
    it time: the run neither waits for it nor leaves it on the machine."""
    left = tmp_path / "left.pid"
    command = [sys.executable, "-c", LEAVES_A_PROCESS.format(child=SLEEPS)]
    reap = [sys.executable, str(REPO / "tools" / "runtime" / "reap.py"), "--leftover-seconds", "1", *command]
    done = subprocess.run(reap, timeout=60, env={**os.environ, "LEFT_PID": str(left)}, capture_output=True, text=True)
    assert done.returncode == 0 and "killed a process the job left running" in done.stderr, done.stderr
    with pytest.raises(ProcessLookupError):
        os.kill(int(left.read_text()), 0)
