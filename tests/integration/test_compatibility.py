"""The pack on the ComfyUI versions its users run: what the running server reports, and a ComfyUI older than the
minimum (0.3.52, or one from before the V3 node API), where the pack must load nothing and say why in one line.

The rest of the integration and browser tiers runs once per ComfyUI version in ``TESTED_VERSIONS``
(``tools/run_tests.py`` sets ``DEVICE_CONTROL_COMFYUI``); these tests check the version under test is the one
the server runs.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.passes import ONCE
from tools.runtime.provision import DEFAULT_VERSION, REPO, comfyui_dir
from tools.runtime.server import ComfyServer


def test_the_server_runs_the_comfyui_under_test(comfy_server):
    assert comfy_server.get("/system_stats")["system"]["comfyui_version"] == DEFAULT_VERSION


@ONCE
@pytest.mark.parametrize(
    ("version", "missing"),
    [("pre-v3", "no V3 node API"), ("0.3.52", "no io.MatchType in its V3 node API")],
    ids=["before the V3 node API", "0.3.52"],
)
def test_a_comfyui_older_than_the_minimum_gets_one_clear_line_and_no_nodes(tmp_path, version, missing):
    server = ComfyServer(tmp_path, version=version)
    try:
        server.start()
        nodes = server.get("/object_info")
        extensions = server.get("/extensions")
    finally:
        server.stop()
    log = server.log_path.read_text()
    ours = [line for line in log.splitlines() if "Device Control" in line or "device_control" in line.lower()]
    assert len(ours) == 1, ours
    assert f"this ComfyUI is too old: {missing}" in ours[0] and "needs ComfyUI 0.3.75 or newer" in ours[0]
    # No traceback but ComfyUI's own (its audio nodes need torchaudio, which the runtime does not install).
    assert log.count("Traceback") == log.count("ModuleNotFoundError: No module named 'torchaudio'")
    assert "KSampler" in nodes and not [name for name in nodes if name.startswith("DeviceControl")]
    assert not [path for path in extensions if "device" in path.lower()]


def test_the_surface_check_finds_every_symbol_in_the_comfyui_under_test(comfy_runtime):
    """``python -m tools.runtime.surface_check``, the command users run on their own ComfyUI, on the tree under test."""
    done = subprocess.run(
        [sys.executable, "-m", "tools.runtime.surface_check", str(comfyui_dir())],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert f"(version {DEFAULT_VERSION})" in done.stdout
    assert done.stdout.rstrip().endswith("Verdict: every required symbol is present.")
