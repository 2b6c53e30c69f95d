"""One device model: the simulated GPU goes through the backend interface like any device, and behaves like a
GPU where that matters (streams and events whose ordering is checked, copies that cost the link's time).

The grep test keeps the product honest: outside the simulated backend's own modules and the settings that
create simulated devices, no code may name the simulated GPU, so no code can take a branch for it.
"""

from __future__ import annotations

import ast
import re
import time
from pathlib import Path

import pytest
import torch

from core.devices.backends import backend_of
from core.devices.memory import capacity_bytes, free_bytes
from core.devices.pinned import pinned_memory
from core.devices.sim.cost import LinkCost
from core.devices.sim.device import SimulatedDevice
from core.devices.sim.link import MissingWaitError
from core.devices.tensors import move_own, traffic
from core.devices.transfer import to_target
from core.errors import InvalidSizeError
from core.placement.engine import partial_model_of
from core.weights import ops
from tests.core.platform_marks import STREAMS_AND_PINNING
from tests.core.small_net import reserve_of, width

REPO = Path(__file__).resolve().parents[2]
PRODUCT = [REPO / "__init__.py", *sorted((REPO / "core").rglob("*.py")), *sorted((REPO / "nodes").rglob("*.py"))]
#: The simulated machine's own package, its backend, and the settings readers that create simulated devices (nothing
#: else may name it).
SIMULATOR = "core/devices/sim/"
ALLOWED = {
    "core/devices/backends/simulated.py",
    "core/devices/backends/__init__.py",  # the registry: which backend drives which kind of device
    "core/detection/__main__.py",  # the command line reads the DEVICE_CONTROL_SIMULATE_* settings
    "nodes/state.py",  # the pack's inventory, made with the backends those settings add
}
NAMES = re.compile(r"simulat|simtensor|sim_device|sim:\d|(^|\.)sim(\.|$)", re.IGNORECASE)
MiB = 1024**2


def simulated_mentions(source: str) -> list[str]:
    """Every place ``source``'s code (not its docstrings or comments) names the simulated GPU."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, ast.alias):
            text = node.name
        elif isinstance(node, ast.ImportFrom):
            text = node.module or ""
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value
        else:
            continue
        if NAMES.search(text):
            found.append(f"line {getattr(node, 'lineno', '?')}: {text[:60]}")
    return found


def test_no_product_code_outside_the_simulated_backend_names_it():
    offenders = {}
    for path in PRODUCT:
        relative = path.relative_to(REPO).as_posix()
        allowed = relative in ALLOWED or relative.startswith(SIMULATOR)
        if not allowed and (found := simulated_mentions(path.read_text())):
            offenders[relative] = found
    assert not offenders, f"code that asks whether a device is simulated: {offenders}"


def test_the_grep_catches_a_simulated_branch():
    branch = "if isinstance(target, SimulatedDevice):\n    compute = torch.device('cpu')\n"
    assert simulated_mentions(branch)
    assert simulated_mentions("from core.devices.sim.tensor import X\n")
    assert simulated_mentions("from ..sim.link import Link\n")
    assert simulated_mentions("kind = 'simulated'\n")
    assert not simulated_mentions('"""A docstring may say: the simulated GPU."""\nx = 1  # and a comment\n')


# -- the interface -----------------------------------------------------------------------------------------


def test_a_simulated_device_answers_through_its_backend():
    device = SimulatedDevice(64 * MiB)
    backend = backend_of(device)
    assert backend.comfy_device(device) == torch.device("cpu") and not backend.comfy_makes_room
    assert capacity_bytes(device) == 64 * MiB and free_bytes(device) == 64 * MiB
    layer = torch.nn.Linear(256, 256)
    move_own(layer, "weight", device)
    assert backend.holds(layer.weight, device) and not backend_of(torch.device("cpu")).holds(layer.weight, "cpu")
    assert free_bytes(device) == 64 * MiB - 256 * 256 * 4
    move_own(layer, "weight", torch.device("cpu"))
    assert backend_of(torch.device("cpu")).holds(layer.weight, torch.device("cpu"))


def test_each_move_is_booked_per_device():
    device = SimulatedDevice(64 * MiB, ordinal=7)
    before = traffic(device).to_device, traffic(device).to_host
    layer = torch.nn.Linear(128, 128)
    move_own(layer, "weight", device)
    to_target(torch.zeros(1024), device)
    move_own(layer, "weight", torch.device("cpu"))
    books = traffic(device)
    assert books.to_device - before[0] == 128 * 128 * 4 + 4096
    assert books.to_host - before[1] == 128 * 128 * 4


# -- streams and events --------------------------------------------------------------------------------------


def _half_streamed(device: SimulatedDevice) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """An eight-layer net with two layers resident on ``device`` and six streaming; an input and the output the
    net gives on the host before it moved."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(*(ops.Linear(width(), width()) for _ in range(8)))
    x = torch.randn(2, width())
    expected = net(x)
    engine = partial_model_of(net)
    engine.load(device, 2 * engine.layers()[0].nbytes + reserve_of(engine.layers()[:1]))
    assert 0 < engine.resident_bytes(device) < engine.total_bytes()
    return net, device.place(x), expected


@STREAMS_AND_PINNING
def test_streamed_weights_are_copied_on_the_side_stream_and_waited_for():
    device = SimulatedDevice(64 * MiB)
    net, x, expected = _half_streamed(device)
    copies = device.link.side.queued
    out = net(x)
    # One copy per group of the ring (core.placement.ring); the reserve holds one of these layers a slot, so each
    # streamed layer is a group of its own here: six copies, each weight and bias crossing together, and a seventh
    # as the last computes, the first group for the next step of a model that runs step after step.
    assert device.link.side.queued == copies + 7
    assert torch.equal(out.cpu(), expected)


@STREAMS_AND_PINNING
def test_a_missing_wait_is_caught(monkeypatch):
    device = SimulatedDevice(64 * MiB)
    net, x, _expected = _half_streamed(device)
    net(x)  # with the wait: fine
    monkeypatch.setattr(type(backend_of(device)), "wait", lambda self, stream, event: None)  # the wait removed
    with pytest.raises(MissingWaitError, match="without waiting for that"):
        net(x)


# -- the link's cost -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "bandwidth", "latency"),
    [("", None, 0.0), ("16GB/s,10us", 16 * 1024**3, 10e-6), ("7GB/s", 7 * 1024**3, 0.0), ("1MiB/s, 2ms", MiB, 2e-3)],
)
def test_a_link_is_written_as_bandwidth_and_latency(text, bandwidth, latency):
    """Sizes are read as everywhere in the pack (GB = GiB = 1024**3 bytes)."""
    cost = LinkCost.parse(text)
    assert cost.bandwidth == bandwidth and cost.latency == pytest.approx(latency) and cost.compute_speedup == 1


def test_a_faster_simulated_gpu_makes_each_copy_that_much_slower_in_host_time():
    """A GPU ten times faster than the host computes a step in a tenth of the host's time; keeping the ratio of
    copying to computing, the host sees each copy take ten times the link's time."""
    cost = LinkCost.parse("1GiB/s,1ms,compute=10x")
    assert cost.compute_speedup == 10 and cost.seconds(1024**3) == pytest.approx(10 * 1.001)


@pytest.mark.parametrize(
    "text",
    ["16GB", "fast", "16GB/s,soon", "0GB/s", "1GB/s,1us,2", "compute=2x", "7GB/s,compute=0.5x", "7GB/s,compute=x"],
)
def test_a_malformed_link_names_the_form(text):
    with pytest.raises(InvalidSizeError, match="DEVICE_CONTROL_SIMULATE_LINK=16GB/s,10us"):
        LinkCost.parse(text)


@STREAMS_AND_PINNING
def test_copies_take_the_links_time_and_side_stream_copies_overlap_the_host():
    device = SimulatedDevice(256 * MiB, link=LinkCost(bandwidth=100 * MiB / 0.1, latency=0.0))  # 100 MiB: 0.1 s
    data = torch.zeros(100 * MiB // 4)
    started = time.monotonic()
    device.place(data)  # blocking: the host waits for the copy
    assert time.monotonic() - started >= 0.09
    backend = backend_of(device)
    assert pinned_memory().lock(data, device)
    try:
        started = time.monotonic()
        with backend.on_stream(backend.side_stream(device)):
            copy = backend.copy_to(data, device, non_blocking=True)
        queued = time.monotonic() - started
        event = backend.record(backend.side_stream(device))
        backend.wait(backend.current_stream(device), event)  # the compute stream (the host) waits here
        waited = time.monotonic() - started
        backend.wait_host(event)  # before its source is unlocked: the host knows the copy ended
    finally:
        pinned_memory().unlock(data)
    assert queued < 0.05 <= 0.09 <= waited  # queued at once, usable only when the copy is done
    assert copy.sum().item() == 0


def test_a_copy_used_after_its_source_was_written_in_place_raises_and_one_used_before_does_not():
    """A real device's copy is a snapshot of its source; the simulated one shares host memory, so a copy used after
    its source was rewritten in place (as ComfyUI's hooks rewrite weights, through ``.data``) fails here instead
    of computing with values a real device could never see."""
    device = SimulatedDevice(64 * MiB)
    backend = backend_of(device)
    weight = torch.nn.Parameter(torch.randn(64, 64))
    stale = backend.copy_to(weight, device, non_blocking=False)
    weight.data.copy_(torch.randn(64, 64))  # no version bump: what a copy made ahead cannot see
    with pytest.raises(RuntimeError, match="written in place"):
        _ = stale * 1
    fresh = backend.copy_to(weight, device)
    assert torch.equal((fresh * 1).cpu(), weight.detach())  # used before any write: checked once, then free
    weight.data.mul_(2)
    _ = fresh * 1  # a copy already used is not checked again (the computation it was for has read it)
