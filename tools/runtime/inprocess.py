"""Import the provisioned ComfyUI into this Python process (CPU mode), and load our pack as ComfyUI does.

Used by fixture generation, by tests that compare our code with ComfyUI's (ComfyUI as the oracle) and by
tests of the bridge against real ComfyUI objects. Must run in the runtime's interpreter.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from tools.runtime.provision import DEFAULT_VERSION, PACK_FOLDER, REPO, comfyui_dir, release_paths


def import_comfy(version: str = DEFAULT_VERSION, *, root: Path | None = None, cpu: bool = True) -> ModuleType:
    """Put ComfyUI ``version`` on ``sys.path`` in CPU mode and return ``comfy.model_management``.

    ``root``: a ComfyUI tree unpacked elsewhere (a GPU machine that has no provisioned runtime), put on the path
    alone. ``cpu=False`` lets ComfyUI use the machine's GPU, as its ``main.py`` does without ``--cpu``.

    Raises:
        RuntimeError: ComfyUI is not provisioned (run ``python3 tools/runtime/provision.py`` first).
    """
    paths = [root] if root is not None else [comfyui_dir(version), *reversed(release_paths(version))]
    if not (paths[0] / "comfy").is_dir():
        raise RuntimeError(
            f"ComfyUI {version} is not provisioned at {paths[0]}; run 'python3 tools/runtime/provision.py' first."
        )
    for path in paths:  # its own pins end up first, as on its server
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    cli_args = importlib.import_module("comfy.cli_args")
    # Without a GPU ComfyUI must run with --cpu, or model_management fails at import.
    cli_args.args.cpu = cpu
    return importlib.import_module("comfy.model_management")


def import_pack(name: str = PACK_FOLDER.replace("-", "_")) -> ModuleType:
    """Import this repository as a package, the way ComfyUI imports a folder of ``custom_nodes/``."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, Path(REPO) / "__init__.py", submodule_search_locations=[str(REPO)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
