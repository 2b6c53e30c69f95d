"""Start a real ComfyUI server with the pack, talk to its HTTP API, and stop it.

Used by the demo and by the integration and browser tests. Standard library only, so the demo can drive
the server from any Python while ComfyUI itself runs in the runtime's virtual environment.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from tools.runtime.forkserver import ForkedProcess, ForkServer, forkable
from tools.runtime.provision import (
    DEFAULT_VERSION,
    RELEASES,
    comfyui_dir,
    make_base_directory,
    release_paths,
    served_frontend,
    venv_python,
)

log = logging.getLogger("device_control.tools")


#: How often a start-up or a prompt is looked at (seconds): most prompts of the tests take well under a second,
#: and a longer wait idles the machine between them.
POLL_S = 0.05
#: How many ports a server whose port was chosen here tries before giving up.
PORT_ATTEMPTS = 3
#: What ComfyUI's log says when its port is taken (aiohttp's OSError, errno 98).
ADDRESS_IN_USE = "address already in use"
#: The image ComfyUI ships in its input folder (Load Image's default).
EXAMPLE_IMAGE = "example.png"


class ComfyError(RuntimeError):
    """ComfyUI refused a prompt, or a prompt failed; the message carries ComfyUI's own explanation."""


class PortTakenError(RuntimeError):
    """ComfyUI exited because another process holds its port."""


#: The words of ComfyUI's ``--cache-ram`` help where its RAM-pressure cache is the default (0.28 and later; 0.3.x
#: caches classically unless asked).
RAM_PRESSURE_DEFAULT = "This is the default caching mode"
#: The flags that choose how ComfyUI caches node outputs: a command that names one keeps its own.
CACHE_FLAGS = ("--cache-classic", "--cache-lru", "--cache-ram", "--cache-none")


def caches_by_ram_pressure(version: str = DEFAULT_VERSION) -> bool:
    """Whether this ComfyUI's default cache drops node outputs (loaded models first) when the machine's available
    RAM falls below a headroom: 10 % of RAM, 2-10 GB (read from its ``--cache-ram`` help)."""
    cli_args = comfyui_dir(version) / "comfy" / "cli_args.py"
    return cli_args.is_file() and RAM_PRESSURE_DEFAULT in cli_args.read_text(encoding="utf-8")


def cache_headroom_args(gib: float, version: str = DEFAULT_VERSION) -> tuple[str, ...]:
    """ComfyUI flags that keep its default cache as it is but drop cached outputs only below ``gib`` of available
    RAM, where the default cache works by RAM pressure; none elsewhere. A test server shares the machine with other
    jobs: with ComfyUI's own headroom (2.35 GiB on a 24 GB machine) whether a model stays cached would depend on
    what else runs, not on the pack."""
    return ("--cache-ram", f"{gib:g}") if caches_by_ram_pressure(version) else ()


#: Fork servers by ComfyUI version (:mod:`tools.runtime.forkserver`): the tests set one up for their ComfyUI, and a
#: server of that version whose own settings allow it starts as its child rather than as a new Python.
FORK_SERVERS: dict[str, ForkServer] = {}


def server_environment(version: str, own: dict[str, str]) -> dict[str, str]:
    """The environment a server of ComfyUI ``version`` runs in: this process's, the server's ``own`` settings, and
    that version's pins first on the import path."""
    env = {**os.environ, **own, "PYTHONUNBUFFERED": "1"}
    first = [str(path) for path in release_paths(version)]
    if first:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [*first, env.get("PYTHONPATH", "")]))
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ComfyServer:
    """One ComfyUI process on 127.0.0.1 with its own base directory (models, outputs, user data).

    Args:
        base: the base directory (created and prepared if needed).
        env: extra environment variables (e.g. ``DEVICE_CONTROL_SIMULATE_GPU``).
        port: the port, or ``None`` for a free one.
        version: which provisioned ComfyUI to run.
        extra_args: more ComfyUI command-line flags.
        cpu: run ComfyUI with ``--cpu`` (required on machines without a GPU).
        cache_headroom_gib: drop cached outputs only below this much available RAM, where ComfyUI's default cache
            works by RAM pressure and ``extra_args`` choose no cache (:func:`cache_headroom_args`); ``None``: its own.
    """

    def __init__(
        self,
        base: Path,
        env: dict[str, str] | None = None,
        port: int | None = None,
        version: str = DEFAULT_VERSION,
        extra_args: tuple[str, ...] = (),
        cpu: bool = True,
        cache_headroom_gib: float | None = None,
    ) -> None:
        self.base = make_base_directory(Path(base), version)
        self.env = env or {}
        self._chosen_port = port is None
        self.port = port or free_port()
        self.version = version
        self.extra_args = extra_args
        self.cpu = cpu
        self.cache_headroom_gib = cache_headroom_gib
        self.process: subprocess.Popen | ForkedProcess | None = None
        self.log_path = self.base / "server.log"

    @property
    def url(self) -> str:
        """The server's address."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180) -> ComfyServer:
        """Start ComfyUI and wait until its API answers.

        A free port can be taken by another process between the moment it was found and ComfyUI's bind: a server
        whose port was chosen here then starts again on another one.

        Raises:
            RuntimeError: ComfyUI exited or did not answer in time (the message ends with its log).
        """
        attempt = 1
        while True:
            try:
                return self._start_once(timeout)
            except PortTakenError:
                if not self._chosen_port or attempt >= PORT_ATTEMPTS:
                    raise
                log.warning("[Device Control] port %d was taken before ComfyUI bound it; trying another", self.port)
                self.port, attempt = free_port(), attempt + 1

    def command(self) -> list[str]:
        """The command line that starts this server (the runtime's Python, ``main.py`` and ComfyUI's flags)."""
        cmd = [
            str(venv_python()),
            "main.py",
            *(["--cpu"] if self.cpu else []),
            "--listen",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--disable-auto-launch",
            *self._directories(),
            *self.extra_args,
        ]
        if self.cache_headroom_gib is not None and not any(flag in self.extra_args for flag in CACHE_FLAGS):
            cmd += cache_headroom_args(self.cache_headroom_gib, self.version)
        frontend = served_frontend(self.version)
        if frontend is not None and "--front-end-root" not in self.extra_args:
            cmd += ["--front-end-root", str(frontend)]
        return cmd

    def _start_once(self, timeout: float) -> ComfyServer:
        self._example_image()
        cmd = self.command()
        env = server_environment(self.version, self.env)
        forker = FORK_SERVERS.get(self.version)
        with open(self.log_path, "ab") as log_file:
            started_at = log_file.tell()  # this start's own lines begin here (the log keeps earlier starts')
            if forker is not None and forkable(self.env):
                self.process = forker.spawn(cmd[1:], comfyui_dir(self.version), env, self.log_path)
            else:
                self.process = subprocess.Popen(
                    cmd,
                    cwd=comfyui_dir(self.version),
                    env=env,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_tail()
                mine = self.log_path.read_bytes()[started_at:].decode(errors="replace").lower()
                error = PortTakenError if ADDRESS_IN_USE in mine else RuntimeError
                raise error(f"ComfyUI exited with {self.process.returncode}:\n{tail}")
            try:
                self.get("/system_stats")
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(POLL_S)
        self.stop()
        raise RuntimeError(f"ComfyUI did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    def _example_image(self) -> None:
        """ComfyUI's ``input/example.png`` in this server's input folder, as a user's ComfyUI has it: the templates
        that load an image name it."""
        shipped, given = comfyui_dir(self.version) / "input" / EXAMPLE_IMAGE, self.base / "input" / EXAMPLE_IMAGE
        if shipped.is_file() and not given.exists():
            given.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shipped, given)

    def _directories(self) -> list[str]:
        if RELEASES[self.version].modern:
            db = self.base / "user" / "comfyui.db"
            return ["--base-directory", str(self.base), "--database-url", f"sqlite:///{db}"]
        return [  # models come from the tree's own folders there: this ComfyUI only has to start
            *("--output-directory", str(self.base / "output")),
            *("--input-directory", str(self.base / "input")),
            *("--temp-directory", str(self.base / "temp")),
        ]

    def stop(self) -> None:
        """Stop ComfyUI (SIGTERM, then SIGKILL after 20 s)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def restart(self) -> ComfyServer:
        """A fresh ComfyUI process on the same port and folders: nothing loaded, cached, or held by the allocator
        from earlier prompts (``free`` unloads models, but the process may keep the memory they took)."""
        self.stop()
        return self.start()

    def __enter__(self) -> ComfyServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 60) -> str:
        """The last lines of the server's log."""
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    # -- HTTP ----------------------------------------------------------------------------------------

    def get(self, path: str, timeout: float = 30) -> Any:
        """GET ``path`` and decode the JSON answer."""
        with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
            return json.load(response)

    def post(self, path: str, body: Any, timeout: float = 30) -> Any:
        """POST ``body`` as JSON to ``path`` and decode the JSON answer (or ``None`` when empty).

        Raises:
            ComfyError: the server answered with an error status; the message holds its body.
        """
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                data = response.read()
        except urllib.error.HTTPError as exc:
            raise ComfyError(f"{path} answered {exc.code}: {exc.read().decode(errors='replace')}") from exc
        return json.loads(data) if data.strip() else None

    def queue(self, prompt: dict[str, Any], client_id: str | None = None) -> str:
        """Queue an API-format prompt; return its id.

        Raises:
            ComfyError: a node failed validation. (ComfyUI itself would still run the outputs that do not
                depend on it; a test must not mistake that partial run for a success.)
        """
        body = {"prompt": prompt, "client_id": client_id or uuid.uuid4().hex}
        answer = self.post("/prompt", body)
        if answer.get("node_errors"):
            raise ComfyError(f"/prompt refused nodes: {json.dumps(answer['node_errors'])}")
        return answer["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 600) -> dict[str, Any]:
        """Wait for a prompt to finish; return its history entry.

        Raises:
            ComfyError: the prompt failed (with ComfyUI's exception message) or timed out.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                history = self.get(f"/history/{prompt_id}")
            except TimeoutError:  # a server whose CPU sampling starves its event loop answers late, not never
                continue
            entry = history.get(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None:
                status = entry["status"]
                if status.get("status_str") != "success":
                    errors = [m[1] for m in status.get("messages", []) if m[0] == "execution_error"]
                    detail = errors[0].get("exception_message", errors[0]) if errors else status
                    raise ComfyError(f"prompt {prompt_id} failed: {detail}")
                return entry
            if self.process is not None and self.process.poll() is not None:
                raise ComfyError(f"ComfyUI exited while running {prompt_id}:\n{self.log_tail()}")
            time.sleep(POLL_S)
        raise ComfyError(f"prompt {prompt_id} did not finish within {timeout:.0f} s")

    def run(self, prompt: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
        """Queue a prompt and wait for it; return its history entry."""
        return self.wait(self.queue(prompt), timeout)

    def forget_outputs(self) -> None:
        """Forget every cached output but keep the models loaded: the next prompt runs each of its nodes again.

        Our nodes are cached like stock ones, so a test that must see a node run (its text, its move, its badge) in a
        server where an earlier test ran the same graph starts from here.
        """
        self._free(unload_models=False)

    def free(self) -> None:
        """Unload every model and forget every cached output, as the frontend's "Free model and node cache"
        does: the next prompt loads its models from disk, as on a fresh server."""
        self._free(unload_models=True)

    def _free(self, *, unload_models: bool) -> None:
        """``POST /free``, then a prompt (a VRAM Report) that makes sure ComfyUI acted on it. ComfyUI's worker reads
        the request after the prompt it runs: one queued at once after the request could run first, with every
        cached output (a test's Move To GPU answered from the cache, so no move to check)."""
        self.post("/free", {"unload_models": unload_models, "free_memory": True})
        self.run({"1": {"class_type": "DeviceControl_VRAMReport", "inputs": {"label": "", "devices": "all"}}})
