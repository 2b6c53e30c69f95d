"""Shared test set-up: tier availability, the synthetic fixtures, and a real ComfyUI server.

A tier that cannot run here (no provisioned ComfyUI, no Chromium) is skipped on a developer's machine,
but fails under ``CI=true`` or ``DEVICE_CONTROL_REQUIRE_ALL_TIERS=1`` (set by ``tools/run_tests.py``):
a green run must mean every tier ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tools.comfy_server import ComfyServer
from tools.runtime import DEFAULT_VERSION, NEWEST_VERSION, comfyui_dir, missing_source

REPO = Path(__file__).resolve().parent.parent
STRICT = (
    os.environ.get("CI", "").lower() in ("1", "true", "yes")
    or os.environ.get("DEVICE_CONTROL_REQUIRE_ALL_TIERS") == "1"
)
ARTIFACTS = REPO / "tests" / "artifacts"


#: Cycles of the soak test in a normal run (sized for CI: ten in the newest ComfyUI's pass, six, four after the
#: warm-up, in the others); ``--soak-cycles 200`` runs the long soak.
SOAK_CYCLES = 10 if DEFAULT_VERSION == NEWEST_VERSION else 6


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak-cycles",
        type=int,
        default=SOAK_CYCLES,
        help=f"load-move-sample-offload cycles of the soak test (default {SOAK_CYCLES}; 200 for the long soak)",
    )


#: Set to 1 on a machine with a GPU: a GPU test that finds none fails instead of skipping.
REQUIRE_GPU_ENV = "DEVICE_CONTROL_REQUIRE_GPU"


def gpus_here() -> int:
    """How many CUDA (or ROCm) devices this machine has."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked ``gpu`` runs where the GPUs it needs are; elsewhere it skips saying what it would prove,
    or fails under ``DEVICE_CONTROL_REQUIRE_GPU=1`` (so a GPU run cannot pass by skipping everything)."""
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return
    needed, found = int(marker.kwargs.get("count", 1)), gpus_here()
    if found >= needed:
        return
    reason = f"needs {needed} GPU(s), found {found}; would prove: {marker.kwargs.get('proves', item.name)}"
    if os.environ.get(REQUIRE_GPU_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_GPU_ENV}=1: the GPU tests must run here)", pytrace=False)
    pytest.skip(reason)


def unavailable(reason: str) -> None:
    """Skip a test whose tier cannot run here, or fail it when every tier is required."""
    if STRICT:
        pytest.fail(f"{reason} (every test tier is required in this run)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def require() -> Callable[[str], None]:
    """The :func:`unavailable` helper, for tests."""
    return unavailable


@pytest.fixture(scope="session")
def comfy_runtime() -> Path:
    """The provisioned ComfyUI tree (the tests must run in the runtime's interpreter)."""
    root = comfyui_dir()
    if not (root / "main.py").exists():
        reason = missing_source(DEFAULT_VERSION)
        unavailable(reason or f"ComfyUI is not provisioned at {root}; run 'python3 tools/runtime.py'")
    return root


@pytest.fixture(scope="session")
def synthetic_models(comfy_runtime: Path) -> dict[str, Path]:
    """The synthetic SD1.5 checkpoint and LoRA (made once, cached between runs)."""
    code = "import json, tools.make_fixtures as m; print(json.dumps({k: str(v) for k, v in m.make_all().items()}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.fail(f"could not make the synthetic models:\n{done.stderr[-3000:]}")
    return {kind: Path(path) for kind, path in json.loads(done.stdout.strip().splitlines()[-1]).items()}


@pytest.fixture(scope="session")
def artifacts() -> Path:
    """A git-ignored folder for screenshots and logs the tests leave behind."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


def start_server(base: Path, env: dict[str, str] | None = None, extra_args: tuple[str, ...] = ()) -> ComfyServer:
    """Start a ComfyUI server with the pack in ``base``; fail with its log if it does not come up."""
    try:
        return ComfyServer(base, env=env, extra_args=extra_args).start()
    except RuntimeError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def comfy_factory() -> Callable[..., ComfyServer]:
    """Starts more servers (e.g. with simulated devices); the caller stops them."""
    return start_server


@pytest.fixture(scope="session")
def comfy_server(synthetic_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyServer]:
    """A real ComfyUI (CPU mode) with the pack and the synthetic models, shared by the session."""
    server = start_server(tmp_path_factory.mktemp("comfy-base"))
    yield server
    server.stop()
