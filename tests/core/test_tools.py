"""The repository's own commands answer ``--help`` with how to use them, and start nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

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
        [sys.executable, "-m", "tools.surface_check", str(tmp_path)], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 1 and "(version 9.9.9)" in done.stdout
    assert "comfy.model_management.load_models_gpu" in done.stdout and "MISSING" in done.stdout
    present = {line.split()[0] for line in done.stdout.splitlines() if line.endswith("  present")}
    expected = {"comfy.model_management.load_models_gpu", "comfy.model_management.vram_state"}
    assert present == expected | {"comfyui_version.__version__"}
    assert "comfy.memory_management.aimdo_enabled" in done.stdout and "absent (optional" in done.stdout


def test_the_surface_check_refuses_a_folder_that_is_not_comfyui(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tools.surface_check", str(tmp_path)], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 2 and "is not a ComfyUI folder" in done.stderr


def test_the_split_benchmark_table_gives_medians_and_the_floor():
    from tools.bench_split import ROWS, table

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
    from tools.fixture_files import hollow

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


def test_each_pass_runs_its_tiers_side_by_side_in_folders_of_their_own():
    """Every ComfyUI's pass runs the integration and browser tiers beside each other; the core tier runs under each
    simulated platform in the primary pass; no two pytests share a folder (each would remove the other's)."""
    from tools import run_tests

    stages = run_tests.full_run(Path("python"), ["0.3.75", "0.28.0", "0.33.0"], [])
    commands = [c for stage in stages for step in stage for c in step.commands]
    folders = [arg for _, command in commands for arg in command if arg.startswith("--basetemp=")]
    assert len(folders) == len(set(folders)) == 3 * 2 + len(run_tests.PROFILES)
    for version, stage in zip(["0.3.75", "0.28.0", "0.33.0"], stages[1:], strict=True):
        tiers = [[arg for arg in command if arg.startswith("tests/")] for step in stage for _, command in step.commands]
        assert tiers[:2] == [["tests/integration"], ["tests/browser"]], version
        assert all(settings["DEVICE_CONTROL_COMFYUI"] == version for step in stage for settings, _ in step.commands)
    simulated = {s.get(run_tests.PLATFORM_ENV) for s, command in commands if "tests/core" in command}
    assert simulated == {None, *run_tests.PROFILES}
    newest = [s for step in stages[-1] for s, _ in step.commands]
    assert {s.get(run_tests.PLATFORM_ENV) for s in newest} == {"windows"}


def test_steps_that_run_beside_another_do_not_spin_torch_threads():
    """ComfyUI's tiers wait passively; the core tier under the simulated platforms, beside the integration tier,
    computes on one thread (docs/bench/ci_threads.txt: spinning threads took the other tier's core)."""
    from tools import run_tests

    stages = run_tests.full_run(Path("python"), ["0.3.75", "0.33.0"], [])
    for stage in stages[1:]:
        for step in stage:
            for settings, command in step.commands:
                expected = run_tests.ONE if "tests/core" in command else run_tests.PASSIVE
                assert expected.items() <= settings.items(), command
