"""Start test servers of ComfyUI by forking a process that has already imported its heavy libraries.

A ComfyUI start spends most of its 7-9 s (on a 2-core machine) importing the same libraries every time: torch (2 s),
torchvision, which imports torch's compiler (2 s), scipy, transformers, SQLAlchemy and Alembic. A test pass starts
about a hundred servers. The fork server is one process of the runtime's Python, started with the environment and
import path a server of its ComfyUI gets, that imports those libraries once and then forks a child for each server;
the child takes the server's folder, arguments, environment and log, and runs ComfyUI's own ``main.py`` as
``python main.py`` would. What ComfyUI does from there is unchanged: it imports itself, the pack and everything else,
reads its arguments and serves; only the libraries above are already in memory, as modules it would import anyway
(:data:`PREIMPORTED`; a test compares them with what a plain start imports), and the objects their imports made are
left out of the garbage collections ComfyUI makes (``gc.freeze``, as Python advises for a process that forks).

A server whose settings could be read while those libraries import (any variable but the pack's own and
:data:`AFTER_IMPORT`) starts as a plain process, as does every server of another ComfyUI than the fork server's.
Only the tests use this (``tests/conftest.py``); the demo and the benchmarks start ComfyUI as a user does.

The fork server speaks JSON lines on its standard input and output:
``{"spawn": {"argv", "cwd", "env", "log"}}`` answers ``{"pid"}``, ``{"poll": pid}`` answers ``{"code"}`` (``null``
while the child runs; the fork server reaps its children).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

#: The libraries the fork server imports before its first fork: each one a ComfyUI start imports anyway (ComfyUI
#: 0.3.75 and later: torchvision's operators through its Stable Cascade coder, torch's compiler through them or
#: through comfy-kitchen, SciPy through its samplers, SQLAlchemy and Alembic through its database, kornia, PyAV and
#: spandrel through its nodes).
PREIMPORTED = (
    "torch",
    "torchvision.ops",
    "torchvision.models",
    "transformers",
    "scipy.stats",
    "safetensors.torch",
    "numpy",
    "PIL.Image",
    "aiohttp",
    "sqlalchemy",
    "alembic.context",
    "kornia",
    "av",
    "spandrel",
)
#: Variables a server may set and still be forked: none of them is read while the libraries above import (the CUDA
#: runtime reads the device list when it starts, which the fork server never does).
AFTER_IMPORT = frozenset({"CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED"})
#: What a variable of the pack's own starts with (the pack reads them when ComfyUI imports it, in the child).
OWN_PREFIX = "DEVICE_CONTROL_"


def forkable(server_env: dict[str, str]) -> bool:
    """Whether a server with these settings of its own (not the inherited environment) may be forked."""
    return all(key.startswith(OWN_PREFIX) or key in AFTER_IMPORT for key in server_env)


class ForkedProcess:
    """A ComfyUI process forked by a :class:`ForkServer`, with the part of :class:`subprocess.Popen` that
    :class:`tools.runtime.server.ComfyServer` uses."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self._server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit status once the process has ended, else ``None``."""
        if self.returncode is None:
            self.returncode = self._server.exit_status(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to end; its exit status.

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.05)
        return self.returncode  # type: ignore[return-value]  # set by poll

    def send_signal(self, number: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, number)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The fork server of one ComfyUI: started on the first :meth:`spawn`, stopped by :meth:`close` (its children
    are servers of their own; stopping them is their owners' part).

    Args:
        python: the runtime's Python.
        comfyui: the ComfyUI folder the children run ``main.py`` in.
        env: the environment of a server of that ComfyUI before its own settings (its import path included).
    """

    def __init__(self, python: Path, comfyui: Path, env: dict[str, str]) -> None:
        self._command = [str(python), "-u", str(Path(__file__).resolve()), str(comfyui)]
        self._comfyui = comfyui
        self._env = env
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._process = subprocess.Popen(
                    self._command,
                    cwd=self._comfyui,
                    env=self._env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            assert self._process.stdin is not None and self._process.stdout is not None
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
            answer = self._process.stdout.readline()
        if not answer:
            raise RuntimeError(f"the fork server ({' '.join(self._command)}) ended; its errors are above")
        return json.loads(answer)

    def spawn(self, argv: list[str], cwd: Path, env: dict[str, str], log: Path) -> ForkedProcess:
        """Run ``argv`` (``main.py`` and ComfyUI's flags) in ``cwd`` with ``env``, its output appended to ``log``."""
        request = {"argv": argv, "cwd": str(cwd), "env": env, "log": str(log)}
        return ForkedProcess(self, self._ask({"spawn": request})["pid"], argv)

    def exit_status(self, pid: int) -> int | None:
        """A child's exit status, or ``None`` while it runs (a child of a fork server that ended: -9 once gone)."""
        try:
            return self._ask({"poll": pid})["code"]
        except (RuntimeError, OSError, ValueError):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return -signal.SIGKILL
            return None

    def close(self) -> None:
        """Stop the fork server (not its children)."""
        with self._lock:
            if self._process is not None and self._process.poll() is None:
                assert self._process.stdin is not None
                self._process.stdin.close()
                try:
                    self._process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._process.kill()
                    self._process.wait()
            self._process = None


def _child(request: dict[str, Any]) -> None:
    """In the forked child: become ``python main.py`` with the request's arguments, folder, environment and log;
    never return."""
    code = 1
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = list(request["argv"])
        sys.path[0] = request["cwd"]
        sys.stdout.reconfigure(write_through=True)  # as PYTHONUNBUFFERED makes a plain start's
        sys.stderr.reconfigure(write_through=True)
        import runpy

        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # a plain start prints the traceback and exits with 1 as well
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # the log may be gone; the exit status still counts
                stream.flush()
        os._exit(code)


def _serve(comfyui: str) -> None:
    """The fork server's loop: import :data:`PREIMPORTED` as a start in ``comfyui`` would, then answer requests
    until its input closes."""
    import importlib

    sys.path[0] = comfyui  # as ``python main.py`` there has it
    for name in PREIMPORTED:
        importlib.import_module(name)
    # What the imports made lives as long as any child: out of every collection the children make (ComfyUI collects
    # after each prompt), so none walks, or copies on write, the libraries' objects (Python's advice for forking).
    gc.freeze()
    children: set[int] = set()
    ended: dict[int, int] = {}
    answers = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                ended[pid] = os.waitstatus_to_exitcode(status)
        if "spawn" in request:
            pid = os.fork()
            if pid == 0:
                _child(request["spawn"])
            children.add(pid)
            answer: dict[str, Any] = {"pid": pid}
        else:
            pid = request["poll"]
            answer = {"code": ended.get(pid, None if pid in children else -signal.SIGKILL)}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    _serve(sys.argv[1])
