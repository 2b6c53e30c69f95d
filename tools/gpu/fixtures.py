"""The GPU benchmark's fixtures, made by the repository's own generators in a second process while it runs.

A bare GPU machine has no models and no network. ``tools/gpu/bench.py`` needs the synthetic SD1.5 checkpoint
(``tools/fixtures/make.py``, about 15 s there), its VAE as a file of its own (for the SDXL case) and the full-size
SDXL UNet (``tools/fixtures/families.py``, about 40 s). :class:`FixtureMaker` starts one process that makes them
in the order the cases need them, each only if no current one is there (the generators keep a version stamp in
the file), and reports each path on a line of its standard output as soon as it is written; the benchmark waits for
a fixture only when a case needs it, so SDXL's is written while SD1.5 runs. The process's log goes to the
benchmark's standard error.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from tools.runtime.provision import REPO

log = logging.getLogger("device_control")

#: The fixtures the cases can ask for.
KEYS = ("sd15_checkpoint", "sd15_vae", "sdxl_unet")


def make_fixture(key: str, root: Path) -> Path:
    """Make fixture ``key`` under ``root`` (in the folders ComfyUI reads: ``checkpoints``, ``vae``,
    ``diffusion_models``) unless a current one is there; its path. ComfyUI must be importable (its detection
    checks each layout before it is written)."""
    from tools.fixtures.families import SDXL_FULL_SIZE, make_diffusion_model
    from tools.fixtures.make import SD15_CHECKPOINT, SD15_VAE, SPLIT_PARTS, make_sd15_checkpoint, make_split_part

    if key == "sd15_checkpoint":
        return make_sd15_checkpoint(root / "checkpoints" / SD15_CHECKPOINT)
    if key == "sd15_vae":
        folder, prefix, renamed = SPLIT_PARTS[SD15_VAE]
        return make_split_part(make_fixture("sd15_checkpoint", root), root / folder / SD15_VAE, prefix, renamed)
    if key == "sdxl_unet":
        return make_diffusion_model(SDXL_FULL_SIZE, root / "diffusion_models" / SDXL_FULL_SIZE.file)
    raise ValueError(f"unknown fixture {key!r}; known: {', '.join(KEYS)}")


def make_fixtures_here(keys: list[str], root: Path, comfyui: Path) -> int:
    """The fixture process: import ComfyUI (CPU mode: this process never touches the GPU), make ``keys`` in
    order, one JSON line ``{"key", "path", "seconds"}`` on standard output after each."""
    from tools.runtime.inprocess import import_comfy

    import_comfy(root=comfyui, cpu=True)
    for key in keys:
        started = time.perf_counter()
        path = make_fixture(key, root)
        line = {"key": key, "path": str(path), "seconds": round(time.perf_counter() - started, 1)}
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()
    return 0


class FixtureMaker:
    """The fixture process, started at once; :meth:`get` waits for one fixture.

    Args:
        keys: the fixtures to make, in the order they will be asked for.
        root: where they are made (or found, when current).
        comfyui: the ComfyUI tree whose detection checks them.
    """

    def __init__(self, keys: list[str], root: Path, comfyui: Path) -> None:
        self.ready: dict[str, dict] = {}
        self.started = time.monotonic()
        command = [sys.executable, str(REPO / "tools" / "gpu" / "bench.py"), "--make-fixtures", ",".join(keys)]
        command += ["--fixtures", str(root), "--comfyui-dir", str(comfyui)]
        log.info("[Device Control] making fixtures %s in %s (a second process)", ", ".join(keys), root)
        self.process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True)

    def get(self, key: str) -> Path:
        """Fixture ``key``'s path, once it is written.

        Raises:
            RuntimeError: the process ended without making it (its log, above, says why).
        """
        stdout: IO[str] | None = self.process.stdout
        while key not in self.ready and stdout is not None:
            line = stdout.readline()
            if not line:
                break
            with_key = json.loads(line)
            with_key["ready_after_s"] = round(time.monotonic() - self.started, 1)
            self.ready[with_key["key"]] = with_key
            log.info("[Device Control] fixture %s ready: %s", with_key["key"], with_key["path"])
        if key not in self.ready:
            code = self.process.wait()
            raise RuntimeError(f"the fixture process ended (exit code {code}) without making {key}; see its log")
        return Path(self.ready[key]["path"])

    def close(self) -> None:
        """Stop the process if it is still making fixtures nobody will ask for."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
