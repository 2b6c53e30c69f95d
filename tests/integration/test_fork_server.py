"""The fork server the tests start ComfyUI through (``tools/runtime/forkserver.py``) gives the ComfyUI a plain start
gives: it imports nothing a plain start does not, a forked server serves and stops as a plain one, and a server whose
settings could change an import starts as a plain process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

from tests.conftest import PLAIN_STARTS_ENV
from tools.runtime.forkserver import PREIMPORTED, ForkedProcess
from tools.runtime.provision import DEFAULT_VERSION, comfyui_dir
from tools.runtime.server import FORK_SERVERS, ComfyServer, server_environment


@pytest.fixture
def forks() -> None:
    """The tests' servers start through the fork server wherever they can (Linux, unless plain starts are asked
    for); elsewhere the test skips."""
    if not sys.platform.startswith("linux") or os.environ.get(PLAIN_STARTS_ENV) == "1":
        pytest.skip("servers start as plain processes here")
    assert DEFAULT_VERSION in FORK_SERVERS, "the tests' fork server was not set up"


def test_every_module_the_fork_server_imports_is_one_a_plain_start_imports(tmp_path):
    """ComfyUI started as ``python main.py`` up to the point where it would serve (``--quick-test-for-ci``): the
    modules it imported include each one the fork server imports before it forks."""
    server = ComfyServer(tmp_path / "plain-base")
    command = server.command()
    modules = tmp_path / "modules.json"
    run = (
        "import atexit, json, runpy, sys\n"
        f"atexit.register(lambda: open({str(modules)!r}, 'w').write(json.dumps(sorted(sys.modules))))\n"
        f"sys.argv = {[*command[1:], '--quick-test-for-ci']!r}\n"
        f"sys.path[0] = {str(comfyui_dir(DEFAULT_VERSION))!r}\n"
        "runpy.run_path('main.py', run_name='__main__')\n"
    )
    env = server_environment(DEFAULT_VERSION, {})
    done = subprocess.run(
        [command[0], "-c", run], cwd=comfyui_dir(DEFAULT_VERSION), env=env, capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    imported = set(json.loads(modules.read_text()))
    assert set(PREIMPORTED) <= imported, sorted(set(PREIMPORTED) - imported)


def test_a_forked_server_serves_stops_and_leaves_no_process(tmp_path, forks):
    server = ComfyServer(tmp_path / "forked-base", env={"DEVICE_CONTROL_SIMULATE_GPU": "8GiB"}).start()
    try:
        assert isinstance(server.process, ForkedProcess)
        stats = server.get("/system_stats")
        assert stats["system"]["comfyui_version"], stats
        assert "simulated GPU" in server.log_path.read_text(), "the pack's setting did not reach the child"
        pid = server.process.pid
    finally:
        server.stop()
    assert server.process.returncode is not None
    assert not psutil.pid_exists(pid), "the stopped server's process was not reaped"


def test_a_server_with_a_setting_read_at_import_starts_as_a_new_python(tmp_path, forks):
    server = ComfyServer(tmp_path / "plain-base", env={"OMP_NUM_THREADS": "1"}).start()
    try:
        assert isinstance(server.process, subprocess.Popen)
    finally:
        server.stop()
