"""The platform matrix (``.github/workflows/platforms.yml``), checked where it cannot run: its syntax, the runners it
asks for, and every command it calls (each script exists, and takes every option the matrix gives it)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
MATRIX = REPO / ".github" / "workflows" / "platforms.yml"


def workflow() -> dict:
    return yaml.safe_load(MATRIX.read_text())


def commands() -> list[list[str]]:
    job = workflow()["jobs"]["core-and-starter"]
    return [shlex.split(step["run"]) for step in job["steps"] if "run" in step]


def test_the_matrix_runs_on_windows_macos_and_linux_and_says_it_has_not_run():
    job = workflow()["jobs"]["core-and-starter"]
    assert set(job["strategy"]["matrix"]["os"]) == {"windows-latest", "macos-latest", "ubuntu-latest"}
    assert job["runs-on"] == "${{ matrix.os }}" and job["strategy"]["fail-fast"] is False
    uses = [step["uses"].split("@")[0] for step in job["steps"] if "uses" in step]
    assert uses == ["actions/checkout", "actions/setup-python"]
    assert "Not run yet" in MATRIX.read_text()


def test_the_matrix_runs_the_core_tier_and_the_starter_end_to_end():
    scripts = [command[1] for command in commands()]
    assert scripts == ["tools/runtime/provision.py", "tools/run_tests.py", "tools/demo.py"]
    assert "--core" in commands()[1] and "--no-serve" in commands()[2]


def test_every_command_the_matrix_calls_exists_and_takes_its_options():
    for command in commands():
        assert command[0] == "python", command  # the runner's Python (setup-python), on every OS
        script = REPO / command[1]
        assert script.is_file(), command
        done = subprocess.run(
            [sys.executable, str(script), "--help"], cwd=REPO, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr
        for option in (arg for arg in command[2:] if arg.startswith("--")):
            assert re.search(rf"{re.escape(option)}\b", done.stdout), f"{command[1]} has no option {option}"
        values = [arg for arg in command[2:] if not arg.startswith("--")]
        assert all(value in done.stdout for value in values), f"{command[1]} takes none of {values}"
