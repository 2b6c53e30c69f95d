"""Device discovery, device strings and their resolution, and tolerance of failing backends.

This machine has no accelerator, so accelerators are described by small static probes: they stand in
for hardware only. Everything else (the CPU probe, the simulated devices, the inventory) is real.
"""

from __future__ import annotations

import pytest
import torch

from core.devices.backends import CpuBackend, DeviceBackend, DeviceInfo, default_backends, simulated_backends
from core.devices.inventory import DeviceInventory, parse_device_spec
from core.devices.pinned import pinned_fraction_from_env
from core.devices.sim.device import SimulatedDevice
from core.devices.sim.spec import simulated_devices_from_env
from core.errors import DeviceNotFoundError, InvalidDeviceSpecError, InvalidSizeError

GiB = 1024**3


class StaticBackend(DeviceBackend):
    """Reports fixed devices, as a machine with that hardware would."""

    def __init__(self, name, devices):
        self.name = name
        self._devices = devices

    def available(self):
        return True

    def devices(self):
        return list(self._devices)


class BrokenBackend(DeviceBackend):
    """A backend whose driver query raises, as a broken or mismatched driver does."""

    name = "cuda"

    def available(self):
        return True

    def devices(self):
        raise RuntimeError("CUDA driver version is insufficient for CUDA runtime version")


def cuda(index, total=8 * GiB, free=6 * GiB):
    return DeviceInfo("", "cuda", f"NVIDIA Test {index}", f"cuda:{index}", total, free, 1 * GiB, 1 * GiB, 1 * GiB)


@pytest.mark.parametrize(
    ("text", "kind", "index"),
    [
        ("auto", "auto", 0),
        ("cpu", "cpu", 0),
        ("gpu", "gpu", 0),
        ("gpu:1", "gpu", 1),
        (" GPU:2 ", "gpu", 2),
        ("cuda:0", "cuda", 0),
        ("xpu:3", "xpu", 3),
        ("npu:1", "npu", 1),
        ("mlu:0", "mlu", 0),
        ("mps", "mps", 0),
        ("directml:0", "directml", 0),
        ("privateuseone:1", "directml", 1),
        ("sim:1", "sim", 1),
    ],
)
def test_device_strings_parse(text, kind, index):
    spec = parse_device_spec(text)
    assert (spec.kind, spec.index) == (kind, index)


@pytest.mark.parametrize("text", ["gpu:x", "tpu:0", "", "gpu:-1", "cuda:0:1", "gpu 0"])
def test_malformed_device_strings_name_the_accepted_forms(text):
    with pytest.raises(InvalidDeviceSpecError, match=r"auto, cpu, gpu:N"):
        parse_device_spec(text)


def test_an_index_on_a_single_device_kind_says_how_to_write_it():
    with pytest.raises(InvalidDeviceSpecError, match="'cpu' takes no index; write just 'cpu'"):
        parse_device_spec("cpu:1")
    assert str(parse_device_spec("cpu:0")) == "cpu"


def test_cpu_probe_reports_real_memory():
    snapshot = DeviceInventory(backends=[CpuBackend()]).snapshot()
    cpu = snapshot.get("cpu")
    assert cpu is not None and cpu.kind == "cpu" and not cpu.is_accelerator
    assert cpu.total > 0 and 0 < cpu.free <= cpu.total
    assert snapshot.host.process_rss > 0
    assert snapshot.host.used == snapshot.host.total - snapshot.host.available


def test_default_probes_run_on_this_machine_without_errors():
    snapshot = DeviceInventory().snapshot()
    assert snapshot.get("cpu") is not None
    assert {b.name for b in snapshot.backends} >= {"cuda", "xpu", "mps", "cpu"}
    assert snapshot.errors == []
    assert len(default_backends()) == 7


def test_accelerators_are_numbered_in_probe_order_then_simulated():
    sim = SimulatedDevice(2 * GiB)
    inventory = DeviceInventory(
        backends=[StaticBackend("cuda", [cuda(0), cuda(1)]), CpuBackend()],
        extra=simulated_backends([sim]),
    )
    snapshot = inventory.snapshot()
    assert [d.id for d in snapshot.devices] == ["gpu:0", "gpu:1", "cpu", "gpu:2"]
    assert inventory.resolve("cuda:1", snapshot=snapshot).device.id == "gpu:1"
    assert inventory.resolve("gpu:2", snapshot=snapshot).device.native == "sim:0"
    assert inventory.resolve("sim:0", snapshot=snapshot).device.id == "gpu:2"
    assert inventory.target("gpu:2", snapshot) is sim
    assert inventory.target("gpu:0", snapshot) == torch.device("cuda:0")
    assert inventory.resolve("auto", snapshot=snapshot).device.id == "gpu:0"


def test_auto_is_the_cpu_without_accelerators():
    inventory = DeviceInventory(backends=[CpuBackend()])
    assert inventory.resolve("auto").device.id == "cpu"


def test_missing_device_raises_with_what_exists_or_falls_back_visibly():
    inventory = DeviceInventory(backends=[StaticBackend("cuda", [cuda(0)]), CpuBackend()])
    with pytest.raises(DeviceNotFoundError, match=r"'gpu:3' does not exist.*gpu:0 \(NVIDIA Test 0\)"):
        inventory.resolve("gpu:3")
    fallback = inventory.resolve("gpu:3", fallback=True)
    assert fallback.device.id == "gpu:0"
    assert "using gpu:0 instead" in fallback.warning
    with pytest.raises(InvalidDeviceSpecError):  # a typo is not a portability problem: it stays an error
        inventory.resolve("gpu:three", fallback=True)


def test_a_missing_device_error_keeps_the_problem_and_the_fix_apart():
    # A node that falls back to another device reports the problem with its own fix: it reads ``problem``, never
    # cuts the message's text (which once broke whenever the fix was reworded).
    inventory = DeviceInventory(backends=[StaticBackend("cuda", [cuda(0)]), CpuBackend()])
    with pytest.raises(DeviceNotFoundError) as caught:
        inventory.resolve("gpu:3")
    assert caught.value.problem.startswith("device 'gpu:3' does not exist on this machine (devices here: ")
    assert "gpu:0 (NVIDIA Test 0)" in caught.value.problem and "pick" not in caught.value.problem
    assert caught.value.fix == "pick one of those, or 'auto'."
    assert str(caught.value) == f"{caught.value.problem}; {caught.value.fix}"


def test_a_broken_backend_is_reported_and_the_others_still_work():
    inventory = DeviceInventory(
        backends=[BrokenBackend(), CpuBackend()], extra=simulated_backends([SimulatedDevice(GiB)])
    )
    snapshot = inventory.snapshot()
    assert [d.id for d in snapshot.devices] == ["cpu", "gpu:0"]
    assert any("driver version is insufficient" in line for line in snapshot.errors)
    status = next(b for b in snapshot.backends if b.name == "cuda")
    assert not status.available and "RuntimeError" in status.error


def test_a_simulated_device_whose_stats_fail_is_listed_with_its_error():
    inventory = DeviceInventory(
        backends=[CpuBackend()], extra=simulated_backends([SimulatedDevice(GiB, faults={"stats"})])
    )
    snapshot = inventory.snapshot()
    sim = snapshot.get("gpu:0")
    assert sim.error is not None and "injected fault" in sim.error
    assert sim.total is None
    assert inventory.resolve("auto", snapshot=snapshot).device.id == "cpu"  # a failed device is not chosen


def test_simulated_device_figures():
    sim = SimulatedDevice(8 * GiB, used_by_others=GiB)
    info = DeviceInventory(backends=[CpuBackend()], extra=simulated_backends([sim])).snapshot().get("gpu:0")
    assert (info.kind, info.total, info.free, info.used_by_others) == ("simulated", 8 * GiB, 7 * GiB, GiB)
    assert info.torch_device is None
    assert info.name == "Simulated GPU 0 (8.00 GiB)"


def test_simulated_devices_from_environment():
    devices = simulated_devices_from_env(
        {
            "DEVICE_CONTROL_SIMULATE_GPU": "8GiB,4GiB",
            "DEVICE_CONTROL_SIMULATE_USED_BY_OTHERS": "512MiB",
            "DEVICE_CONTROL_SIMULATE_FAULTS": "stats",
        }
    )
    assert [d.capacity for d in devices] == [8 * GiB, 4 * GiB]
    assert [d.label for d in devices] == ["sim:0", "sim:1"]
    assert all(d.used_by_others == 512 * 1024**2 and d.faults == {"stats"} for d in devices)
    assert simulated_devices_from_env({}) == []
    with pytest.raises(InvalidSizeError):
        simulated_devices_from_env({"DEVICE_CONTROL_SIMULATE_GPU": "eight"})


@pytest.mark.parametrize(("text", "expected"), [("", 0.45), ("0.2", 0.2), ("0", 0.0), ("1", 1.0)])
def test_the_pinned_memory_share_is_read_from_the_environment(text, expected):
    assert pinned_fraction_from_env({"DEVICE_CONTROL_MAX_PINNED_FRACTION": text}) == expected
    assert pinned_fraction_from_env({}) == 0.45


@pytest.mark.parametrize("text", ["most", "nan", "-0.1", "1.5", "45%"])
def test_a_pinned_memory_share_that_cannot_be_used_names_the_fix(text):
    with pytest.raises(InvalidSizeError, match=r"is not a share of RAM from 0 to 1; write it like .*=0\.45"):
        pinned_fraction_from_env({"DEVICE_CONTROL_MAX_PINNED_FRACTION": text})
