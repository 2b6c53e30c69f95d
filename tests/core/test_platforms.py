"""The machines ComfyUI users run, simulated (``core.devices.sim.platforms``): Windows, 64 KiB-page arm64 Linux and
macOS, each on this x86-64 Linux machine through the one host-memory module (``core.devices.host_memory``).

Each rule of a simulated platform is paired with a deliberately wrong engine that must fail it: the engine as it was
before host memory had a module of its own (Unix-only ``mmap`` flags, 4 KiB pages written in the code, the CUDA
runtime's error looked up in ``/proc``), or one that ignores what the platform allows.
"""

from __future__ import annotations

import ast
import ctypes
import mmap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from core.detection.headers import read_header
from core.devices import host_memory
from core.devices.backends import CudaBackend, backend_of
from core.devices.backends.simulated import simulated_backends
from core.devices.host_memory import page_block, page_size, platform, platform_in_use
from core.devices.inventory import DeviceInventory
from core.devices.pinned import PinnedMemory, count_foreign_registrations, pinned_memory
from core.devices.sim.device import SimulatedDevice
from core.devices.sim.host import ALREADY_MAPPED, OUT_OF_MEMORY, REGISTRY
from core.devices.sim.platforms import PLATFORM_ENV, PROFILES, platform_from_env, simulated_platform
from core.files.reader import WeightReader
from core.placement import slabs
from core.placement.engine import partial_model_of
from core.weights import ops
from tests.core.order_net import on_host, streamed_net
from tests.core.platform_marks import STREAMS_AND_PINNING
from tests.core.small_net import reserve_of

REPO = Path(__file__).resolve().parents[2]
KiB, MiB = 1024, 1024**2
#: Where a Windows build of torch keeps the CUDA runtime it loads.
WINDOWS_CUDART = "C:\\ComfyUI_windows_portable\\python_embeded\\Lib\\site-packages\\torch\\lib\\cudart64_12.dll"


@pytest.fixture
def on_windows() -> Iterator[None]:
    with platform_in_use(simulated_platform("windows")):
        yield


def streamed_run():
    """The small net with two layers resident and the rest streamed through its ring on a simulated GPU, run once:
    its output, the host's, and its engine."""
    net, device, x = streamed_net()
    with torch.no_grad():
        out = net(device.place(x)).cpu()
    return out, on_host(net, x), partial_model_of(net)


# -- page blocks, on every platform ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*PROFILES, None], ids=[*PROFILES, "this machine"])
def test_page_blocks_start_on_a_page_and_hold_whole_pages_on_every_platform(name):
    with platform_in_use(None if name is None else simulated_platform(name)):
        block = page_block(5000)
        assert block.data_ptr() % page_size() == 0 and block.numel() % page_size() == 0 and block.numel() >= 5000
        block.fill_(7)
        assert int(block.sum()) == 7 * block.numel()


def test_the_setting_chooses_a_platform_and_a_wrong_name_lists_the_right_ones():
    assert platform_from_env({}) is None
    assert platform_from_env({PLATFORM_ENV: "Windows"}).page == 4 * KiB
    assert platform_from_env({PLATFORM_ENV: "linux-64k"}).page == 64 * KiB
    assert platform_from_env({PLATFORM_ENV: "macos"}).page == 16 * KiB
    with pytest.raises(ValueError, match="windows, linux-64k, macos"):
        platform_from_env({PLATFORM_ENV: "beos"})


# -- Windows: its mmap, no /proc, a driver limit ---------------------------------------------------------------


def test_windows_mmap_refuses_unix_flags_and_maps_at_its_allocation_granularity(on_windows):
    windows = platform().mmap
    assert not hasattr(windows, "MAP_PRIVATE") and not hasattr(windows, "MADV_DONTNEED")
    with pytest.raises(TypeError):
        windows.mmap(-1, 4 * KiB, flags=mmap.MAP_PRIVATE)
    assert page_block(4 * KiB).data_ptr() % (64 * KiB) == 0


def _unix_only_anonymous(module, size):
    """The wrong engine: a page block made as the engine made it before, with Unix's flags whatever the OS."""
    return module.mmap(-1, size, flags=module.MAP_PRIVATE | module.MAP_ANONYMOUS)


def test_a_streamed_load_on_windows_makes_its_slabs_and_computes_as_the_host(on_windows, monkeypatch):
    out, expected, engine = streamed_run()
    assert torch.equal(out, expected)
    assert engine.ring._slabs and all(slab.pinned for slab in engine.ring._slabs)
    engine.unload_all()
    monkeypatch.setattr(host_memory, "_anonymous", _unix_only_anonymous)
    with pytest.raises(AttributeError, match="MAP_PRIVATE"):  # the engine as it was: every streamed load raised
        streamed_run()


def test_a_file_converted_on_windows_is_read_through_staging_as_its_pages_cannot_be_given_back(on_windows, tmp_path):
    weights = torch.randn(64, 32, generator=torch.Generator().manual_seed(3)).to(torch.float16)
    save_file({"w": weights}, str(tmp_path / "w.safetensors"))
    out = torch.empty(64, 32, dtype=torch.float32)
    with WeightReader(read_header(tmp_path / "w.safetensors")) as reader:
        assert reader._map is None  # no madvise on Windows: a mapping would hold the whole file by the end
        reader.read_into("w", out)
    assert torch.equal(out, weights.float())


def test_the_driver_refuses_past_half_of_ram_and_our_cap_stays_within_it():
    with platform_in_use(simulated_platform("windows", ram=64 * MiB)):
        device = SimulatedDevice(64 * MiB)
        books = PinnedMemory()
        assert books.max_bytes <= platform().registration_cap() == 32 * MiB
        blocks = [page_block(4 * MiB) for _ in range(10)]
        locked = [block for block in blocks if books.lock(block, device)]
        assert len(locked) == 7 and not books.failed  # the cap ends it before the driver would have
        for block in locked:
            books.unlock(block)
        wrong = PinnedMemory(max_bytes=int(0.9 * 64 * MiB))  # the wrong engine: a cap past the driver's limit
        assert len([block for block in blocks if wrong.lock(block, device)]) == 8 and wrong.failed
        for block in blocks:
            wrong.unlock(block)
        assert REGISTRY.register(blocks[0].data_ptr(), 40 * MiB) is False and REGISTRY.take_error() == OUT_OF_MEMORY


class FakeCudart:
    """torch's binding of the CUDA runtime as torch 2.14 has it: the registration calls, no ``cudaGetLastError``."""

    def __init__(self, runtime: FakeRuntimeLibrary, refuse: bool) -> None:
        self.runtime, self.refuse, self.registered = runtime, refuse, []

    def cudaHostRegister(self, pointer: int, size: int, flags: int) -> int:  # noqa: N802 - the runtime's name
        self.registered.append(pointer)
        if self.refuse:
            self.runtime.pending = 712  # cudaErrorHostMemoryAlreadyRegistered, left as the last error
            return 712
        return 0

    def cudaHostUnregister(self, pointer: int) -> int:  # noqa: N802
        return 0


class FakeRuntimeLibrary:
    """The CUDA runtime library a process loaded (``cudart64_12.dll``), with its last error."""

    def __init__(self) -> None:
        self.pending = 0

    def cudaGetLastError(self) -> int:  # noqa: N802 - the runtime's name
        error, self.pending = self.pending, 0
        return error

    def cudaGetErrorString(self, code: int) -> bytes:  # noqa: N802
        return ALREADY_MAPPED.encode() if code == 712 else b"unknown error"


@pytest.fixture
def cuda_on_windows(monkeypatch):
    """A CUDA GPU on Windows: torch's binding and the runtime DLL, faked; the backend and the books are ours."""

    def make(*, dll: bool, refuse: bool) -> tuple[FakeCudart, FakeRuntimeLibrary]:
        runtime = FakeRuntimeLibrary()
        cudart = FakeCudart(runtime, refuse)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
        monkeypatch.setattr(CudaBackend, "is_pinned", lambda self, tensor: False)
        libraries = {WINDOWS_CUDART: runtime} if dll else {}
        stack = platform_in_use(simulated_platform("windows", libraries=libraries))
        stack.__enter__()
        request_finalizers.append(lambda: stack.__exit__(None, None, None))
        return cudart, runtime

    request_finalizers: list = []
    yield make
    for finalize in request_finalizers:
        finalize()


def test_on_windows_a_failed_page_lock_is_read_back_through_the_runtime_dll(cuda_on_windows):
    cudart, runtime = cuda_on_windows(dll=True, refuse=True)
    assert not PinnedMemory(max_bytes=MiB).lock(page_block(64 * KiB), torch.device("cuda"))
    assert cudart.registered and runtime.pending == 0  # read back: no kernel will raise it as its own


def test_where_the_runtime_error_cannot_be_read_back_nothing_is_registered(cuda_on_windows):
    cudart, _runtime = cuda_on_windows(dll=False, refuse=False)
    assert not PinnedMemory(max_bytes=MiB).lock(page_block(64 * KiB), torch.device("cuda"))
    assert not cudart.registered  # fail closed: copies block, and no error can be left pending


def test_the_error_looked_up_in_proc_as_before_stays_pending_on_windows(cuda_on_windows, monkeypatch):
    """The wrong engine: the runtime looked up in ``/proc/self/maps`` (which Windows has not): the error stays."""
    _cudart, runtime = cuda_on_windows(dll=True, refuse=True)
    monkeypatch.setattr(host_memory.CudaRuntime, "reads_errors", lambda self: True)
    monkeypatch.setattr(host_memory.CudaRuntime, "_last_error_call", lambda self: _from_proc("cudaGetLastError"))
    PinnedMemory(max_bytes=MiB).lock(page_block(64 * KiB), torch.device("cuda"))
    assert runtime.pending == 712  # the next kernel would raise "already mapped" as its own
    runtime.pending = 0


def _from_proc(name: str):
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
        return next((getattr(ctypes.CDLL(path), name) for path in sorted(paths)), None)
    except OSError:
        return None


# -- several GPUs, and GPUs ComfyUI does not see ----------------------------------------------------------------


class FakeNvml:
    """NVIDIA's management library (``nvml.dll``): the driver has ``count`` GPUs."""

    def __init__(self, count: int) -> None:
        self.count = count

    def nvmlInit_v2(self) -> int:  # noqa: N802 - the library's names
        return 0

    def nvmlDeviceGetCount_v2(self, reference) -> int:  # noqa: N802
        reference._obj.value = self.count
        return 0

    def nvmlShutdown(self) -> int:  # noqa: N802
        return 0


def test_gpus_the_driver_has_and_comfyui_does_not_see_are_reported_with_what_to_start_it_with(monkeypatch):
    from tests.core.test_backends import FakeCard, FakeTorchModule

    monkeypatch.setattr(torch, "cuda", FakeTorchModule([FakeCard("RTX 4090")]), raising=False)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with platform_in_use(simulated_platform("windows", libraries={"nvml.dll": FakeNvml(2)})):
        hidden = CudaBackend().hidden_devices()
        snapshot = DeviceInventory(backends=[CudaBackend()]).snapshot()
    assert (hidden.count, hidden.total, hidden.setting) == (1, 2, "CUDA_VISIBLE_DEVICES=0")
    [note] = snapshot.notes
    assert "sees 1 of the 2 cuda GPUs" in note and "--cuda-device all" in note


def test_simulated_gpus_follow_cuda_visible_devices_as_a_driver_does():
    devices = [SimulatedDevice(8 * 1024 * MiB, ordinal=i) for i in range(3)]
    [backend] = simulated_backends(devices, {"CUDA_VISIBLE_DEVICES": "2,0"})
    assert [device.label for device in backend.simulated] == ["sim:2", "sim:0"]
    assert backend.hidden_devices().count == 1
    [everything] = simulated_backends(devices, {})
    assert len(everything.simulated) == 3 and everything.hidden_devices() is None


# -- 64 KiB pages -----------------------------------------------------------------------------------------------


def _registrations_comfyui_would_make(engine) -> list[bool]:
    """Each streamed weight registered on its own and kept so, as ComfyUI's ``pin_memory`` does for an offloaded
    model's weights (the slabs unlocked); all undone after."""
    backend, done, kept = backend_of(SimulatedDevice(MiB)), [], []
    for slab in engine.ring._slabs:
        for module in slab.modules:
            for _name, tensor in slabs.tensors_of(module):
                done.append(backend.pin(tensor.data_ptr(), tensor.numel() * tensor.element_size()))
                if done[-1]:
                    kept.append(tensor.data_ptr())
                else:
                    REGISTRY.take_error()
    for pointer in kept:
        backend.unpin(pointer)
    return done


def _slabs_before(monkeypatch):
    """The wrong engine: slabs as they were, 4 KiB pages written in the code."""
    monkeypatch.setattr(slabs, "page_size", lambda: 4 * KiB)


def _streamed_odd_net() -> tuple[torch.Tensor, torch.Tensor, object]:
    """Layers whose weights are no whole number of 64 KiB pages (100 x 100 floats), streamed and run once."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(*(ops.Linear(100, 100) for _ in range(8)))
    x = torch.randn(2, 100)
    expected = net(x)
    device = SimulatedDevice(64 * MiB)
    engine = partial_model_of(net)
    engine.load(device, reserve_of(engine.layers()[:1]))  # everything streams
    with torch.no_grad():
        out = net(device.place(x)).cpu()
    return out, expected, engine


def test_on_64k_pages_no_two_locked_ranges_share_a_page(monkeypatch):
    with platform_in_use(simulated_platform("linux-64k")):
        out, expected, engine = _streamed_odd_net()
        assert torch.allclose(out, expected)
        ring = engine.ring
        assert all(slab.pinned and slab.block.data_ptr() % (64 * KiB) == 0 for slab in ring._slabs)
        for slab in ring._slabs:
            slab.unlock()  # as its model leaves the device: ComfyUI may now pin the weights one by one
        assert all(_registrations_comfyui_would_make(engine))
        engine.unload_all()
        _slabs_before(monkeypatch)
        _out, _expected, wrong = _streamed_odd_net()
        for slab in wrong.ring._slabs:
            slab.unlock()
        assert not all(_registrations_comfyui_would_make(wrong))  # weights share 64 KiB pages
        wrong.unload_all()


# -- macOS: unified memory, no registration, no streams ---------------------------------------------------------


def test_on_macos_the_gpu_streams_without_streams_or_page_locking_and_computes_as_the_host(monkeypatch):
    with platform_in_use(simulated_platform("macos")):
        out, expected, engine = streamed_run()
        assert torch.equal(out, expected) and engine.ring.stats.copies > 0
        device = SimulatedDevice(MiB)
        assert backend_of(device).side_stream(device) is None and not backend_of(device).can_pin
        assert pinned_memory().pinned_bytes == 0 and not pinned_memory().failed  # nothing was even tried
        engine.unload_all()
        monkeypatch.setattr(PinnedMemory, "_may_register", lambda self, target: True)  # the wrong engine
        _out, _expected, wrong = streamed_run()
        assert pinned_memory().failed  # it asked the device to register, which MPS cannot: refused, logged
        wrong.unload_all()
        pinned_memory().retry()


# -- one set of books with ComfyUI's registrations -----------------------------------------------------------


@STREAMS_AND_PINNING
def test_comfyuis_registrations_count_against_the_cap_and_their_pages_are_never_registered_again():
    device = SimulatedDevice(64 * MiB)
    theirs = page_block(2 * page_size())
    assert backend_of(device).pin(theirs.data_ptr(), page_size() + 8)  # ComfyUI's pin_memory of one weight
    count_foreign_registrations(lambda: {theirs.data_ptr(): page_size() + 8})
    try:
        books = PinnedMemory(max_bytes=4 * page_size())
        assert books.foreign_bytes() == page_size() + 8
        assert not books.lock(theirs[page_size() + 64 :], device)  # on their second page: refused, not tried
        assert REGISTRY.take_error() is None
        assert not books.lock(page_block(3 * page_size()), device)  # theirs and this would pass the cap
        assert books.lock(page_block(2 * page_size()), device)
    finally:
        count_foreign_registrations(None)
        backend_of(device).unpin(theirs.data_ptr())


# -- nothing else speaks to the OS --------------------------------------------------------------------------------

#: The module whose job is to speak to the OS (the simulated platforms build on what it hands out).
OS_MODULES = {"core/devices/host_memory.py"}
#: Imports of OS-specific modules, and attribute reads that ask which OS this is or call its own API.
OS_IMPORTS = {"mmap", "ctypes", "fcntl", "msvcrt", "winreg", "resource", "_winapi", "nt", "posix", "winsound"}
OS_ATTRIBUTES = {
    ("sys", "platform"),
    ("os", "name"),
    ("os", "uname"),
    ("os", "sysconf"),
    ("os", "preadv"),
    ("os", "pread"),
    ("platform", "system"),
    ("platform", "win32_ver"),
    ("platform", "mac_ver"),
    ("platform", "uname"),
    ("torch.cuda", "cudart"),
}


def os_calls(source: str) -> list[str]:
    """Every place ``source`` imports an OS-specific module, asks which OS it runs on, reads ``/proc`` or calls
    the CUDA runtime."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] in OS_IMPORTS]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in OS_IMPORTS and not node.level:
            found.append(f"line {node.lineno}: from {node.module}")
        elif isinstance(node, ast.Attribute) and (ast.unparse(node.value), node.attr) in OS_ATTRIBUTES:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("/proc"):
            found.append(f"line {node.lineno}: {node.value}")
    return found


def test_nothing_but_the_host_memory_module_speaks_to_the_os():
    product = [*sorted((REPO / "core").rglob("*.py")), *sorted((REPO / "nodes").rglob("*.py")), REPO / "__init__.py"]
    offenders = {}
    for path in product:
        relative = path.relative_to(REPO).as_posix()
        if relative not in OS_MODULES and (found := os_calls(path.read_text())):
            offenders[relative] = found
    assert not offenders, f"OS-specific calls outside core/devices/host_memory.py: {offenders}"


def test_the_walk_catches_each_kind_of_os_call():
    source = (
        "import mmap\nimport sys\nfrom ctypes import CDLL\nimport torch\n"
        "x = sys.platform\nopen('/proc/self/maps')\ntorch.cuda.cudart().cudaHostRegister(1, 2, 1)\n"
    )
    assert len(os_calls(source)) == 5
    assert os_calls("import os\nx = os.path.join('a')\n") == []
