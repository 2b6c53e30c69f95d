"""Installed through the real ComfyUI-Manager, from a git URL, the pack loads in a real ComfyUI.

ComfyUI-Manager (``comfyui-manager`` on the package index, its ``cm-cli``) installs a pack from a git URL as
the "Install via Git URL" button does: it clones it into ``custom_nodes/`` and installs its requirements.
Here the URL is this repository's HEAD served on 127.0.0.1. What cannot run offline is not tested: installing
by name from the Comfy Registry, and the manager's own UI inside ComfyUI.
"""

from __future__ import annotations

import ast
import shutil
import subprocess

import pytest

from tools.runtime.manager import cm_cli, manager_reads, served_repository
from tools.runtime.provision import PACK_FOLDER, REPO, comfyui_dir
from tools.runtime.server import ComfyServer


def _registered_nodes() -> set[str]:
    """Every ``node_id`` the pack's node schemas declare, read from ``nodes/`` (not a copy that falls behind)."""
    found = set()
    for source in sorted((REPO / "nodes").glob("*.py")):
        for call in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            for keyword in getattr(call, "keywords", ()):
                if keyword.arg == "node_id" and isinstance(keyword.value, ast.Constant):
                    found.add(keyword.value.value)
    return found


OUR_NODES = _registered_nodes()


@pytest.fixture(scope="module")
def installed(comfy_runtime, synthetic_models, tmp_path_factory):
    """A copy of the ComfyUI tree into whose ``custom_nodes`` ComfyUI-Manager installed the pack; and its log."""
    tree = tmp_path_factory.mktemp("manager") / "ComfyUI"
    shutil.copytree(comfyui_dir(), tree, symlinks=True, ignore=shutil.ignore_patterns(PACK_FOLDER, "__pycache__"))
    with served_repository(tmp_path_factory.mktemp("git-server")) as url:
        done = cm_cli(tree, "install", url)
    return tree, url, done


def test_comfyui_manager_installs_the_pack_from_a_git_url(installed):
    tree, url, done = installed
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"[INSTALLED] {url}" in done.stdout
    pack = tree / "custom_nodes" / PACK_FOLDER
    head = subprocess.run(["git", "-C", str(pack), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    ours = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    assert head.stdout == ours.stdout  # a clone of what the URL serves, not a link to this checkout
    assert "requirements.txt" not in done.stderr and "safetensors" in done.stdout  # its requirements were handled


def test_the_server_then_loads_our_nodes(installed, api):
    tree, _url, _done = installed
    server = ComfyServer(tree).start()  # its own tree as base directory: custom_nodes/ holds the manager's clone
    try:
        assert (tree / "custom_nodes" / PACK_FOLDER).is_dir() and not (tree / "custom_nodes" / PACK_FOLDER).is_symlink()
        assert set(server.get("/object_info")) >= OUR_NODES
        text = api.report_text(server.run(api.report_prompt()))
        assert text.startswith("VRAM Report") and "Devices:" in text
    finally:
        server.stop()


def test_comfyui_manager_reads_our_metadata(installed):
    """The reader ComfyUI-Manager uses for packs from the registry (it needs the ``.tracking`` file a registry
    install leaves) and its version parser accept our ``pyproject.toml``."""
    tree, _url, _done = installed
    pack = tree / "custom_nodes" / PACK_FOLDER
    (pack / ".tracking").write_text("")
    assert manager_reads(tree, pack) == "comfyui-device-control 0.1.0"
