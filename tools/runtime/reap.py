"""Run one job of ``tools/run_tests.py`` so that its CPU figure is the whole job's.

The CPU time ``wait4`` reports for a process counts only the descendants that were waited for along the chain to it.
A browser job's Chromium leaves processes whose parent ended first (its renderers and helpers); the kernel gives them
to init, and their CPU, most of a browser job's, went unreported (``docs/bench/ci_cpu_where.txt``). Here this process
becomes a Linux child subreaper: such processes become its children instead, and it waits for them before it exits,
so the job's parent reads their CPU too. Where the OS has no subreapers (macOS, Windows), the command runs as it is.

    python3 tools/runtime/reap.py [--nice N] [--leftover-seconds S] command...
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time

#: ``prctl``'s option that makes the calling process a subreaper (linux/prctl.h).
PR_SET_CHILD_SUBREAPER = 36
#: How long the processes a command left behind get to end on their own before they are killed (a browser's helpers
#: end within a second of it; a process still there after this is a leak the job must not keep running).
LEFTOVER_SECONDS = 20.0

log = logging.getLogger("device_control.tools")


def become_subreaper() -> bool:
    """Make this process the subreaper of what it starts; whether the OS has them."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError, TypeError):  # no C library to load by name (Windows), or no prctl in it
        return False


def reap_leftovers(deadline: float) -> None:
    """Wait for every child still here (the ones given to this process); after ``deadline`` kill those left, and
    then what they leave in turn, each named in the log: a job must stop what it starts."""
    killed: set[int] = set()
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid:
            continue
        if time.monotonic() > deadline:
            for child, command in _children():
                if child not in killed:  # one line each, however long the kernel takes to end it
                    log.warning("[Device Control] killed a process the job left running: %s %s", child, command)
                    killed.add(child)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
        time.sleep(0.1)


def _children() -> list[tuple[int, str]]:
    """This process's children and their command lines, read from ``/proc`` (a subreaper's OS keeps them there)."""
    own, found = str(os.getpid()), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            with open(f"/proc/{entry}/stat") as stat:
                parent = stat.read().rsplit(")", 1)[1].split()[1]
            if parent == own:
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    found.append((int(entry), cmdline.read().replace(b"\0", b" ").decode(errors="replace")[:200]))
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--nice", type=int, default=0, help="run the command this much lower in priority")
    parser.add_argument("--leftover-seconds", type=float, default=LEFTOVER_SECONDS)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.nice and hasattr(os, "nice"):  # an OS with priorities: the command and all it starts run at this one
        os.nice(args.nice)
    subreaper = become_subreaper()
    code = subprocess.call(args.command)
    if subreaper:
        reap_leftovers(time.monotonic() + args.leftover_seconds)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
