"""ComfyUI servers shared by the test modules that start one with the same settings.

Each start of ComfyUI with the pack costs 6-7 s on an idle 2-core machine and two to three times that in a loaded
pass, and most modules ask for the same few servers (one simulated 8 GiB GPU above all).
A server a module is done with goes back to the pool with its models unloaded and its cached outputs forgotten
(``ComfyServer.free``); the next module that asks for the same settings gets it with its user settings cleared, as a
fresh server's are. What a test sees is then what a fresh server shows, but for the log (earlier modules' lines come
before its own) and the files in ``output/``. A test that needs a fresh process (a memory baseline, a log read from
the start) starts its own server (``comfy_factory``).

Each server holds whole models in RAM while it works and about 1.3 GB idle, so the pool keeps few of them running:
when a module takes one, idle ones go first, the least used (then the least recently used), while more than
:data:`KEEP` would run or the machine has less than :data:`FLOOR` of RAM available (a module that takes a warm server
on a machine short of memory still gets the others' RAM); and one that still holds more than :data:`IDLE_MAX` when
its module is done is stopped.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

from tools.runtime.server import ComfyServer

log = logging.getLogger("device_control.tests")

#: A server's settings: its environment variables and ComfyUI flags.
Key = tuple[tuple[tuple[str, str], ...], tuple[str, ...]]
#: How many pooled servers may run at once: the one a module uses and one idle (the simulated 8 GiB GPU's server,
#: asked for most, stays as the least used go first).
KEEP = 2
#: Idle servers are stopped before a new one starts while less RAM than this is available, and a server given back
#: then is not kept: on a machine already short of memory (another tier runs beside this one), the room the next
#: module's models need comes before a faster start of a later module.
FLOOR = 6 * 1024**3
#: An idle server that still holds more RAM than this after its models were unloaded (the allocator keeps what
#: they took, at times: 3.9 GB seen) is stopped rather than kept; one that gave it back holds about 0.8 GB.
IDLE_MAX = 2 * 1024**3


#: The lock two test processes side by side share (``tools/run_tests.py`` runs two ComfyUIs' integration tiers at
#: once where the RAM holds them): a module that holds several full-size models at once takes it alone, every other
#: module shares it, so that no other tier's module holds models while a heavy one runs (the pack refuses a load
#: that does not fit in the RAM available, and did, with a second SD1.5 checkpoint beside the other tier).
RAM_LOCK = Path(tempfile.gettempdir()) / "device-control-tests-ram.lock"


@contextlib.contextmanager
def machine_ram(alone: bool, lock: Path = RAM_LOCK) -> Iterator[None]:
    """Hold ``lock`` for a module: ``alone`` for one that loads several full-size models, shared for the others.
    Where the OS has no ``flock`` (Windows) nothing is held: the tiers run there one at a time."""
    if importlib.util.find_spec("fcntl") is None:
        yield
        return
    import fcntl

    with open(lock, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def wait_for_ram(nbytes: int, timeout: float = 600.0) -> None:
    """Wait, at most ``timeout`` seconds, until ``nbytes`` of RAM are available: a test that loads more in its own
    process than a module of the job beside it leaves free (the light modules take no turn of :func:`machine_ram`)
    waits for that module's models to go rather than have the pack refuse its load. After the timeout it goes on,
    and the pack's own refusal says what was short."""
    deadline = time.monotonic() + timeout
    if psutil.virtual_memory().available < nbytes:
        log.info(
            "waiting for %.1f GiB of RAM available (%.1f now)",
            nbytes / 2**30,
            psutil.virtual_memory().available / 2**30,
        )
    while psutil.virtual_memory().available < nbytes and time.monotonic() < deadline:
        time.sleep(2.0)


def key_of(env: dict[str, str], extra_args: tuple[str, ...]) -> Key:
    """The settings that make two servers interchangeable."""
    return tuple(sorted(env.items())), tuple(extra_args)


class ServerPool:
    """Started servers by their settings, handed out to one module at a time and kept between modules.

    Args:
        start: starts a server in a new base directory named after its first user, with these settings.
        keep: how many pooled servers may run at once.
    """

    def __init__(self, start: Callable[[str, dict[str, str], tuple[str, ...]], ComfyServer], keep: int = KEEP) -> None:
        self._start = start
        self._keep = keep
        self._idle: dict[Key, ComfyServer] = {}
        self._busy: list[ComfyServer] = []
        self._uses: dict[Key, int] = {}
        self._last: dict[Key, int] = {}
        self._clock = 0
        #: How many servers the pool started and how many times it handed one out again (for the run's log).
        self.started = 0
        self.reused = 0

    def take(self, name: str, env: dict[str, str], extra_args: tuple[str, ...] = ()) -> ComfyServer:
        """A running server with these settings, nothing loaded or cached and no user settings: an idle one, or a
        new one (``name`` names its base directory)."""
        key = key_of(env, extra_args)
        self._clock += 1
        self._uses[key] = self._uses.get(key, 0) + 1
        self._last[key] = self._clock
        server = self._idle.pop(key, None)
        self._make_room()  # the server taken counts as running, idle or new
        if server is not None and server.process is not None and server.process.poll() is None:
            _clear_user_settings(server)
            self.reused += 1
        else:
            server = self._start(name, env, extra_args)
            self.started += 1
        self._busy.append(server)
        return server

    def give_back(self, server: ComfyServer) -> None:
        """A module is done with ``server``: its models are unloaded now (their RAM is the next module's), and it
        waits for the next module with its settings; one that no longer answers is stopped."""
        self._busy = [s for s in self._busy if s is not server]
        key = key_of(server.env, server.extra_args)
        try:
            server.free()
        except Exception as exc:  # a module may leave it dead or failing: the next one gets a fresh process
            log.warning("[Device Control] a shared test server could not be reset (%s); it is stopped", exc)
            server.stop()
            return
        if key in self._idle or _resident(server) > IDLE_MAX or psutil.virtual_memory().available < FLOOR:
            server.stop()  # on a machine short of memory (another tier beside this one), RAM before a warm start
            return
        self._idle[key] = server

    def stop_idle(self) -> None:
        """Stop every idle server: a module about to run a server of its own (one that loads many models) wants
        their RAM more than the next module wants a warm start."""
        for server in self._idle.values():
            server.stop()
        self._idle.clear()

    def close(self) -> None:
        """Stop every server of the pool."""
        for server in [*self._busy, *self._idle.values()]:
            server.stop()
        self._busy.clear()
        self._idle.clear()

    def _make_room(self) -> None:
        """Stop idle servers, the least used first (then the least recently used), while the one about to be handed
        out would make more than :data:`KEEP` run, or the machine has less than :data:`FLOOR` of RAM available."""
        while self._idle and (
            len(self._idle) + len(self._busy) >= self._keep or psutil.virtual_memory().available < FLOOR
        ):
            key = min(self._idle, key=lambda k: (self._uses[k], self._last[k]))
            self._idle.pop(key).stop()


def _resident(server: ComfyServer) -> int:
    """The RAM a server's process holds (0 for one that is gone)."""
    try:
        return psutil.Process(server.process.pid).memory_info().rss if server.process is not None else 0
    except psutil.NoSuchProcess:
        return 0


def _clear_user_settings(server: ComfyServer) -> None:
    """Remove the frontend settings earlier modules saved (a fresh server has none): ComfyUI reads the file at each
    request."""
    for settings in (Path(server.base) / "user").glob("*/comfy.settings.json"):
        settings.unlink()
