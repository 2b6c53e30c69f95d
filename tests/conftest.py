"""Shared test set-up: tier availability, the synthetic fixtures, and a real ComfyUI server.

A tier that cannot run here (no provisioned ComfyUI, no Chromium) is skipped on a developer's machine,
but fails under ``CI=true`` or ``DEVICE_CONTROL_REQUIRE_ALL_TIERS=1`` (set by ``tools/run_tests.py``):
a green run must mean every tier ran.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.passes import keep_to_their_passes
from tests.server_pool import ServerPool
from tools.runtime.forkserver import ForkServer
from tools.runtime.provision import DEFAULT_VERSION, comfyui_dir, missing_source, venv_python
from tools.runtime.server import FORK_SERVERS, ComfyServer, server_environment

REPO = Path(__file__).resolve().parent.parent
STRICT = (
    os.environ.get("CI", "").lower() in ("1", "true", "yes")
    or os.environ.get("DEVICE_CONTROL_REQUIRE_ALL_TIERS") == "1"
)
ARTIFACTS = REPO / "tests" / "artifacts"


#: Cycles of the soak test in a normal run (sized for CI; it runs in the long checks' pass only);
#: ``--soak-cycles 200`` runs the long soak.
SOAK_CYCLES = 10
#: The available RAM below which a test server's ComfyUI drops cached outputs, where its cache works by RAM pressure
#: (0.28 and later): its own headroom is 10 % of the machine's RAM, and a test job shares the machine with another.
CACHE_HEADROOM_GIB = 0.5


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak-cycles",
        type=int,
        default=SOAK_CYCLES,
        help=f"load-move-sample-offload cycles of the soak test (default {SOAK_CYCLES}; 200 for the long soak)",
    )


#: Set on a machine with a GPU: to 1, a GPU test fails instead of skipping where the machine has no GPU at all
#: (so a GPU run cannot pass by skipping everything), while a test that needs more GPUs than the machine has
#: (the two-GPU tests on a one-GPU machine) still skips, saying so; to N, a test that needs up to N GPUs fails
#: where fewer are found (2 on a two-GPU machine, so the two-GPU tests cannot pass by skipping either).
REQUIRE_GPU_ENV = "DEVICE_CONTROL_REQUIRE_GPU"


def gpus_here() -> int:
    """How many CUDA (or ROCm) devices this machine has."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def required_gpus() -> int:
    """How many GPUs this run requires (:data:`REQUIRE_GPU_ENV`; 0 when unset).

    Raises:
        pytest.UsageError: the variable is set to something other than a whole number of GPUs.
    """
    value = os.environ.get(REQUIRE_GPU_ENV, "").strip()
    if value.lower() in ("", "0", "false", "no"):
        return 0
    if value.lower() in ("true", "yes"):
        return 1
    try:
        return max(0, int(value))
    except ValueError:
        message = f"{REQUIRE_GPU_ENV}={value!r}: set it to the number of GPUs this run requires"
        raise pytest.UsageError(message) from None


def gpu_shortfall(needed: int, found: int, required: int) -> tuple[str, bool] | None:
    """Why a test that needs ``needed`` GPUs cannot run where ``found`` are, and whether that fails the run
    (``required`` GPUs were asked for) rather than skipping; ``None`` when it can run. A test fails only
    when the machine lacks GPUs the run requires: on a one-GPU machine under ``REQUIRE_GPU=1`` the two-GPU
    tests skip, as that machine cannot run them and the run never claimed it could."""
    if found >= needed:
        return None
    fails = found < min(needed, required)
    return f"needs {needed} GPU(s), found {found}", fails


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each ComfyUI's pass runs its share of the integration and browser tests (:mod:`tests.passes`)."""
    keep_to_their_passes(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Leave what the imports made out of every later garbage collection. The checks after each test collect
    garbage (a slab in a reference cycle must be freed, and its registration given back, before the books are
    read), and a full collection walks every object alive: with torch and every test module imported, about
    0.18 s each, 207 s of the core tier's 290 s (measured on this project's CI machine kind). Frozen, the objects
    made before the first test are never walked again: the tier takes 58 s, and what each test leaves is still
    collected."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked ``gpu`` runs where the GPUs it needs are; elsewhere it skips saying what it would prove,
    or fails where the machine has fewer GPUs than :data:`REQUIRE_GPU_ENV` requires."""
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return
    required = required_gpus()
    shortfall = gpu_shortfall(int(marker.kwargs.get("count", 1)), gpus_here(), required)
    if shortfall is None:
        return
    why, fails = shortfall
    reason = f"{why}; would prove: {marker.kwargs.get('proves', item.name)}"
    if fails:
        pytest.fail(f"{reason} ({REQUIRE_GPU_ENV}={required}: this run requires {required} GPU(s))", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(autouse=True)
def cuda_clean(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test marked ``gpu`` starts from the same state of the GPUs it uses, and leaves them so.

    Before: cached memory given back, and the one-time allocations of the kernels every test runs made by a
    warm-up (cuBLAS and cuBLASLt keep a workspace per stream, 33 MiB on an H100, allocated through the caching
    allocator at the first matmul and counted in ``memory_allocated``: a baseline read before it is short by
    that much after the test's first matmul), then the peak statistics reset. A test reads its baselines after
    this. After: what the test left referenced freed and the cache given back, so that the memory a test held
    (a blocker that filled the device, a failed test's frames) cannot make the next test run out of memory or
    count in its baseline. Tests without the marker are untouched (and never initialise CUDA)."""
    marker = request.node.get_closest_marker("gpu")
    if marker is None:
        yield
        return
    import torch

    devices = [torch.device("cuda", index) for index in range(int(marker.kwargs.get("count", 1)))]
    for device in devices:
        _settle(device)
        _warm_up(device)
        _settle(device)
        torch.cuda.reset_peak_memory_stats(device)
    yield
    # pytest keeps a failed test's exception, and through its traceback the test's frames and every tensor
    # they hold, in sys.last_* for post-mortem debugging until the next test's call: let go of them now.
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    for device in devices:
        _settle(device)


def _settle(device: object) -> None:
    """Everything queued on ``device`` done, unreferenced tensors collected, and cached memory given back."""
    import torch

    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def _warm_up(device: object) -> None:
    """Run once the kinds of kernel the GPU tests run, so that their one-time allocations are made before a
    baseline is read: a matmul (cuBLAS's workspace) and a linear layer with a bias (cuBLASLt's), in the
    dtypes the tests use."""
    import torch

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        a = torch.ones(64, 64, device=device, dtype=dtype)
        torch.nn.functional.linear(a @ a, a, a[0])
    torch.cuda.synchronize(device)


class VramBlocker:
    """Fills a GPU so that only a chosen amount stays free, and gives it all back after the test (not through
    the test's frames, which a failure keeps alive)."""

    def __init__(self) -> None:
        self._blocks: list[object] = []

    def leave(self, free: int, device: object = "cuda:0") -> None:
        """Allocate what is free on ``device`` beyond ``free`` bytes. The cache is given back first and the
        free figure read after that: memory the caching allocator reserved would otherwise be counted as taken
        while the test's allocations could still use it."""
        import torch

        _settle(device)
        available = torch.cuda.mem_get_info(device)[0]
        self._blocks.append(torch.empty(max(0, available - free), dtype=torch.uint8, device=device))

    def release(self) -> None:
        """Give back every block."""
        self._blocks.clear()


@pytest.fixture
def vram_blocker(cuda_clean: None) -> Iterator[VramBlocker]:
    """A :class:`VramBlocker` for a GPU test; its blocks are freed before the GPUs are settled after the test."""
    blocker = VramBlocker()
    yield blocker
    blocker.release()


def unavailable(reason: str) -> None:
    """Skip a test whose tier cannot run here, or fail it when every tier is required."""
    if STRICT:
        pytest.fail(f"{reason} (every test tier is required in this run)")
    pytest.skip(reason)


def _heap_trimmer() -> Callable[[int], int] | None:
    """The C library's ``malloc_trim`` where it has one (glibc), else None (macOS, Windows, musl)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


_TRIM_HEAP = _heap_trimmer()


@pytest.fixture(autouse=True, scope="module")
def heap_given_back() -> Iterator[None]:
    """After each module, give the memory its tests freed back to the OS. Modules that build models in this
    process (ComfyUI's loaders as the oracle) leave 1-4.5 GB in the C allocator's free lists once the models are
    gone (measured on 0.3.75: 5.5 GB to 1.0 GB after ``test_split_loaders``); kept, it is RAM the servers of the
    next modules, and a tier running beside this one, do not have."""
    yield
    if _TRIM_HEAP is not None:
        gc.collect()
        _TRIM_HEAP(0)


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
        unavailable(reason or f"ComfyUI is not provisioned at {root}; run 'python3 tools/runtime/provision.py'")
    return root


@pytest.fixture(scope="session")
def synthetic_models(comfy_runtime: Path) -> dict[str, Path]:
    """The synthetic SD1.5 checkpoint and LoRA (made once, cached between runs)."""
    code = "import json, tools.fixtures.make as m; print(json.dumps({k: str(v) for k, v in m.make_all().items()}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.fail(f"could not make the synthetic models:\n{done.stderr[-3000:]}")
    return {kind: Path(path) for kind, path in json.loads(done.stdout.strip().splitlines()[-1]).items()}


@pytest.fixture(scope="session")
def artifacts() -> Path:
    """A git-ignored folder for screenshots and logs the tests leave behind."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="module")
def module_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder for the files one test module writes (a GGUF and its twin: up to a gigabyte), removed when the
    module is done: pytest keeps its folders to the end of a run, and a full pass would otherwise hold every
    module's files at once on a disk that is not ours to fill."""
    folder = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    yield folder
    _forget_model_folders(folder)
    shutil.rmtree(folder, ignore_errors=True)


def _forget_model_folders(folder: Path) -> None:
    """Take ``folder`` and the folders under it out of an in-process ComfyUI's model folders before it goes: its
    file-list cache reads the time of every folder it listed, and fails on one that is gone."""
    folder_paths = sys.modules.get("folder_paths")
    if folder_paths is None:
        return
    for paths, _extensions in folder_paths.folder_names_and_paths.values():
        paths[:] = [path for path in paths if not Path(path).is_relative_to(folder)]
    folder_paths.filename_list_cache.clear()


#: Set to 1 to start every test server as a new Python, as the demo does, rather than through the fork server: to
#: tell a fault of the fork server from one of ComfyUI.
PLAIN_STARTS_ENV = "DEVICE_CONTROL_PLAIN_STARTS"


@pytest.fixture(scope="session", autouse=True)
def fork_server() -> Iterator[None]:
    """The servers of this pass's ComfyUI start through a fork server (:mod:`tools.runtime.forkserver`): five of a
    start's 7-9 s are imports every start repeats. Linux only: forking a process that has loaded torch is not safe
    on macOS, and Windows cannot fork."""
    if os.environ.get(PLAIN_STARTS_ENV) == "1" or not sys.platform.startswith("linux"):
        yield
        return
    forker = ForkServer(venv_python(), comfyui_dir(DEFAULT_VERSION), server_environment(DEFAULT_VERSION, {}))
    FORK_SERVERS[DEFAULT_VERSION] = forker
    try:
        yield
    finally:
        FORK_SERVERS.pop(DEFAULT_VERSION, None)
        forker.close()


#: Each ComfyUI server this pytest started: the settings it started with and the seconds its start took (printed at
#: the end of the run: where a pass's time goes outside its tests' own work).
SERVER_STARTS: list[tuple[str, float]] = []


def start_server(base: Path, env: dict[str, str] | None = None, extra_args: tuple[str, ...] = ()) -> ComfyServer:
    """Start a ComfyUI server with the pack in ``base``; fail with its log if it does not come up. Its cache keeps
    what it caches while :data:`CACHE_HEADROOM_GIB` of RAM is available (unless ``extra_args`` choose a cache)."""
    started = time.monotonic()
    try:
        server = ComfyServer(base, env=env, extra_args=extra_args, cache_headroom_gib=CACHE_HEADROOM_GIB).start()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    settings = " ".join([*(f"{k}={v}" for k, v in sorted((env or {}).items())), *extra_args]) or "(defaults)"
    SERVER_STARTS.append((settings, time.monotonic() - started))
    return server


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How many ComfyUI servers the run started, by their settings, and the time their starts took."""
    if not SERVER_STARTS:
        return
    by_settings: dict[str, list[float]] = {}
    for settings, seconds in SERVER_STARTS:
        by_settings.setdefault(settings, []).append(seconds)
    total = sum(seconds for _, seconds in SERVER_STARTS)
    terminalreporter.write_sep("=", f"{len(SERVER_STARTS)} ComfyUI servers started in {total:.0f} s")
    for settings, times in sorted(by_settings.items(), key=lambda item: -sum(item[1])):
        terminalreporter.write_line(f"{len(times):3d} x {sum(times):6.1f} s  {settings}")


@pytest.fixture(scope="session")
def comfy_factory() -> Callable[..., ComfyServer]:
    """Starts more servers (e.g. with simulated devices); the caller stops them."""
    return start_server


@pytest.fixture(scope="session")
def server_pool(synthetic_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerPool]:
    """The servers the integration and browser modules share by their settings (:mod:`tests.server_pool`)."""

    def start(name: str, env: dict[str, str], extra_args: tuple[str, ...]) -> ComfyServer:
        return start_server(tmp_path_factory.mktemp(name), env=env, extra_args=extra_args)

    pool = ServerPool(start)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def comfy_server(synthetic_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyServer]:
    """A real ComfyUI (CPU mode) with the pack and the synthetic models, shared by the session."""
    server = start_server(tmp_path_factory.mktemp("comfy-base"))
    yield server
    server.stop()
