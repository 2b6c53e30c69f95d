"""Pack what a bare GPU machine with no network needs beside the repository into ``gpu_carry/`` (git-ignored).

A GPU machine lent for a short run receives the repository's working tree and a few ignored folders, 64 MiB in
all, and can install nothing from the network. Its Python has torch, transformers, safetensors, scipy, psutil,
aiohttp, PIL, yaml and pytest; ComfyUI itself and what it imports beyond that must travel:

* ``comfyui-<version>.tar.gz``: the provisioned, unmodified ComfyUI tree without its tests, its API nodes (paid
  online services), ``output/``, ``user/`` and byte code (about 6.5 MB);
* ``wheels/``: ``torchsde`` and ``trampoline`` (ComfyUI's samplers import torchsde) and ``gguf`` (the pack's GGUF
  fixtures and tests, which every fixture maker imports), pure-Python wheels;
* PyAV has a stand-in in the repository (``tools/gpu/stand_ins/``), which travels with the tree.

``tools/gpu/session.sh`` unpacks and installs them there. Run here, after ``python3 tools/runtime/provision.py``::

    python3 tools/gpu/carry.py [--version 0.3.75] [--dest gpu_carry]

Only ``--dest`` is written. Add ``/gpu_carry/`` to ``.git/info/exclude`` (not ``.gitignore``: it is this
workplace's transfer folder, not the project's) so that it travels only when named.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import tarfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.runtime.provision import PRIMARY_VERSION, REPO, comfyui_dir

log = logging.getLogger("device_control.tools")

#: Wheels ComfyUI and the pack's fixture makers need that the GPU machine's Python lacks (the runtime's pins).
WHEELS = ("torchsde==0.2.6", "trampoline==0.1.2", "gguf==0.19.0")
#: The GPU machine's Python.
PYTHON_VERSION = "3.12"
#: Top-level parts of the ComfyUI tree that stay behind: its tests, its paid API nodes, what it writes.
LEFT_OUT = frozenset({"tests", "tests-unit", "comfy_api_nodes", "output", "user", "temp", ".git"})
#: What travels at most, of the 64 MiB a call carries (the repository's own files take the rest).
LIMIT = 40 * 1024**2


def _keep(member: tarfile.TarInfo) -> tarfile.TarInfo | None:
    """The tar filter: no byte code, nothing of :data:`LEFT_OUT` at the top of the tree."""
    parts = Path(member.name).parts
    if len(parts) > 1 and parts[1] in LEFT_OUT:
        return None
    if "__pycache__" in parts or member.name.endswith(".pyc"):
        return None
    return member


def pack_comfyui(version: str, dest: Path) -> Path:
    """``dest/comfyui-<version>.tar.gz``: the provisioned tree, less :data:`LEFT_OUT`, under ``comfyui-<version>/``."""
    root = comfyui_dir(version)
    if not (root / "comfy").is_dir():
        raise SystemExit(
            f"[Device Control] ComfyUI {version} is not provisioned at {root}; run tools/runtime/provision.py."
        )
    target = dest / f"comfyui-{version}.tar.gz"
    with tarfile.open(target, "w:gz") as archive:
        archive.add(root, arcname=f"comfyui-{version}", filter=_keep)
    log.info("[Device Control] %s: %.1f MiB", target, target.stat().st_size / 1024**2)
    return target


def download_wheels(dest: Path) -> list[Path]:
    """The :data:`WHEELS` for the GPU machine's Python, from the package index (no dependencies: each is named)."""
    folder = dest / "wheels"
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", PYTHON_VERSION, "--implementation", "cp", "-d", str(folder), *WHEELS]
    subprocess.run(command, check=True)
    wheels = sorted(folder.glob("*.whl"))
    log.info("[Device Control] wheels: %s", ", ".join(w.name for w in wheels))
    return wheels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=PRIMARY_VERSION, help="the ComfyUI version to pack")
    parser.add_argument("--dest", type=Path, default=REPO / "gpu_carry")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.dest.mkdir(parents=True, exist_ok=True)
    pack_comfyui(args.version, args.dest)
    download_wheels(args.dest)
    total = sum(f.stat().st_size for f in args.dest.rglob("*") if f.is_file())
    log.info("[Device Control] %s holds %.1f MiB", args.dest, total / 1024**2)
    if total > LIMIT:
        raise SystemExit(f"[Device Control] {args.dest} holds {total / 1024**2:.1f} MiB, over {LIMIT // 1024**2} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
