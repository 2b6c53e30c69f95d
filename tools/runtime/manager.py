"""Install the pack with the real ComfyUI-Manager, from a git URL, as users do; for the tests.

ComfyUI-Manager's command line (``cm-cli``, from the ``comfyui-manager`` package on the package index) is
installed apart, with the few packages it needs that the runtime lacks, and run with the runtime's Python
(ComfyUI's own environment, where it installs a pack's requirements). The pack is served over HTTP from a
bare clone of this repository's HEAD on 127.0.0.1 (git's "dumb" HTTP protocol): a git URL like any other,
without leaving the machine. Standard library only, besides the manager itself.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

from tools.runtime.provision import PACK_FOLDER, REPO, _run, _stamp_ok, ensure_venv, runtime_dir, venv_python

#: ComfyUI-Manager and what its command line imports that the runtime does not already have (pinned).
MANAGER_PACKAGES = (
    "comfyui-manager==4.3",
    "typer==0.29.2",
    "click==8.5.1",
    "shellingham==1.5.4",
    "rich==15.0.0",
    "markdown-it-py==4.3.0",
    "mdurl==0.1.2",
    "pygments==2.21.0",
    "GitPython==3.2.1",
    "gitdb==4.0.12",
    "smmap==5.0.3",
    "toml==0.10.2",
    "chardet==7.7.0",
    "nh3==0.3.8",
)


def manager_packages() -> Path:
    """The folder ComfyUI-Manager is installed in (once), apart from the runtime's own packages."""
    target = runtime_dir() / "packages" / "comfyui-manager"
    stamp = target / ".device_control_packages"
    wanted = "\n".join(MANAGER_PACKAGES)
    if not _stamp_ok(stamp, wanted):
        shutil.rmtree(target, ignore_errors=True)
        _run([ensure_venv(), "-m", "pip", "install", "-q", "--no-deps", "--target", target, *MANAGER_PACKAGES])
        stamp.write_text(wanted)
    return target


@contextlib.contextmanager
def served_repository(workdir: Path) -> Iterator[str]:
    """This repository's HEAD as a git URL on 127.0.0.1 (a bare clone served over HTTP); yields the URL."""
    bare = workdir / f"{PACK_FOLDER}.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(REPO), str(bare)], check=True)
    subprocess.run(["git", "-C", str(bare), "update-server-info"], check=True)
    handler = functools.partial(_QuietHandler, directory=str(workdir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/{bare.name}"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Requests are not logged (git makes dozens)."""


def cm_cli(comfyui: Path, *args: str) -> subprocess.CompletedProcess:
    """Run ComfyUI-Manager's command line on the ComfyUI tree ``comfyui`` (its ``custom_nodes`` is where it
    installs), with the runtime's Python; the manager's own packages come after the runtime's."""
    code = (
        "import runpy, sys\n"
        f"sys.path.append({str(manager_packages())!r})\n"
        "sys.argv = ['cm-cli', *sys.argv[1:]]\n"
        "runpy.run_module('cm_cli', run_name='__main__')\n"
    )
    env = {**os.environ, "COMFYUI_PATH": str(comfyui)}
    return subprocess.run(
        [str(venv_python()), "-c", code, *args], cwd=comfyui, env=env, capture_output=True, text=True, check=False
    )


def manager_reads(comfyui: Path, pack: Path) -> str:
    """What ComfyUI-Manager's own code makes of the pack's ``pyproject.toml`` (its version parser and the
    reader it uses for packs from the registry), as it prints it."""
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(comfyui)!r}); sys.path.append({str(manager_packages())!r})\n"
        "from comfyui_manager.common import cnr_utils, manager_util\n"
        f"info = cnr_utils.read_cnr_info({str(pack)!r})\n"
        "print(info['id'], manager_util.StrictVersion(info['version']))\n"
    )
    env = {**os.environ, "COMFYUI_PATH": str(comfyui)}
    done = subprocess.run([str(venv_python()), "-c", code], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]
