"""The device probes against fakes of each device module torch (or an extension) would give them.

No machine here has a GPU, so each probe is run against a stand-in for the module it reads (``torch.cuda`` with
and without ``torch.version.hip``, ``torch.xpu``, ``torch.npu``, ``torch.mlu``, ``torch.mps``,
``torch_directml``) that reproduces that module's API shape: several devices, none, a function some versions
lack (``mem_get_info``, ``recommended_max_memory``), and exceptions. What is checked is the product's probe
code (``core.devices.backends`` and the inventory), never the fakes.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from dataclasses import dataclass, field

import psutil
import pytest
import torch

from core.devices import backends
from core.devices.inventory import DeviceInventory
from core.devices.sim.device import SimulatedDevice

GiB = 1024**3


@dataclass
class FakeCard:
    """One device as a CUDA-style module describes it."""

    name: str
    total: int = 8 * GiB
    free: int = 6 * GiB
    allocated: int = 1 * GiB
    reserved: int = 2 * GiB
    major: int = 8
    minor: int = 6
    arch: str = ""
    fails: str = ""  # "name" or "memory": that query raises


@dataclass
class FakeTorchModule:
    """The CUDA-style API of ``torch.cuda`` / ``torch.xpu`` / ``torch.npu`` / ``torch.mlu``."""

    cards: list[FakeCard] = field(default_factory=list)
    with_mem_get_info: bool = True
    reset: list[int] = field(default_factory=list)

    def is_available(self) -> bool:
        return bool(self.cards)

    def device_count(self) -> int:
        return len(self.cards)

    def get_device_name(self, index: int) -> str:
        if self.cards[index].fails == "name":
            raise RuntimeError("device is lost")
        return self.cards[index].name

    def memory_allocated(self, index: int) -> int:
        if self.cards[index].fails == "memory":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.cards[index].allocated

    def memory_reserved(self, index: int) -> int:
        return self.cards[index].reserved

    def max_memory_allocated(self, index: int) -> int:
        return self.cards[index].allocated + 1

    def reset_peak_memory_stats(self, index: int) -> None:
        self.reset.append(index)

    def get_device_properties(self, index: int) -> types.SimpleNamespace:
        card = self.cards[index]
        return types.SimpleNamespace(total_memory=card.total, major=card.major, minor=card.minor, gcnArchName=card.arch)

    def __getattr__(self, name: str):
        if name == "mem_get_info" and self.with_mem_get_info:
            return lambda index: (self.cards[index].free, self.cards[index].total)
        raise AttributeError(name)


@pytest.fixture
def fake(monkeypatch):
    """Install a fake device module as ``torch.<name>`` (and ``torch.version.hip`` for ROCm)."""

    def install(name: str, module: object, hip: str | None = None) -> object:
        monkeypatch.setattr(torch, name, module, raising=False)
        monkeypatch.setattr(torch.version, "hip", hip, raising=False)
        return module

    return install


def test_cuda_reports_every_card_with_its_memory_and_what_it_computes_in(fake):
    cards = [
        FakeCard("RTX 2060", major=7, minor=5),
        FakeCard("RTX 4090", total=24 * GiB, free=20 * GiB, major=8, minor=9),
    ]
    module = fake("cuda", FakeTorchModule(cards))
    backend = backends.CudaBackend()
    assert backend.name == "cuda" and backend.available()
    first, second = backend.devices()
    assert (first.name, first.native, first.total, first.free) == ("RTX 2060", "cuda:0", 8 * GiB, 6 * GiB)
    assert (first.torch_allocated, first.torch_reserved, first.used_by_others) == (GiB, 2 * GiB, 0)
    assert first.dtypes == ("fp32", "fp16")  # Turing: no bf16, no fp8
    assert second.dtypes == ("fp32", "fp16", "bf16", "fp8") and second.native == "cuda:1"
    assert second.peak_allocated == GiB + 1
    backend.reset_peaks()
    assert module.reset == [0, 1]


def test_reports_and_profile_readings_leave_torchs_peak_counters_alone_by_default(fake, monkeypatch):
    monkeypatch.delenv("DEVICE_CONTROL_PEAKS", raising=False)
    module = fake("cuda", FakeTorchModule([FakeCard("RTX 3090"), FakeCard("RTX 3060")]))
    inventory = DeviceInventory(backends=[backends.CudaBackend(), backends.CpuBackend()])
    inventory.take_reading()  # a node of the memory profile starts, and ends
    inventory.take_reading()
    inventory.snapshot()  # a VRAM Report, then the start of its next interval
    inventory.reset_peaks()
    assert module.reset == []  # another tool's torch.cuda.max_memory_allocated is what torch counted
    DeviceInventory(backends=[backends.CudaBackend()], peak_mode="reset").reset_peaks()
    assert module.reset == [0, 1]  # DEVICE_CONTROL_PEAKS=reset: the old exact measure


class GaugedTorchModule(FakeTorchModule):
    """``torch.cuda`` where the management library answers (utilisation, temperature), or raises as torch does
    without pynvml/amdsmi (``fails``); counts the calls."""

    def __init__(self, cards: list[FakeCard], fails: bool = False) -> None:
        super().__init__(cards)
        self.fails, self.calls = fails, 0

    def utilization(self, index: int) -> int:
        self.calls += 1
        if self.fails:
            raise ModuleNotFoundError("No module named 'pynvml'")
        return 40 + index

    def temperature(self, index: int) -> int:
        self.calls += 1
        if self.fails:
            raise ModuleNotFoundError("No module named 'pynvml'")
        return 60 + index


def test_utilisation_and_temperature_are_read_where_the_driver_reports_them_and_none_elsewhere(fake):
    fake("cuda", GaugedTorchModule([FakeCard("RTX 3090"), FakeCard("RTX 3060")]))
    first, second = backends.CudaBackend().devices()
    assert (first.utilization, first.temperature, second.utilization, second.temperature) == (40, 60, 41, 61)
    module = fake("cuda", GaugedTorchModule([FakeCard("RTX 3090")], fails=True))
    backend = backends.CudaBackend()
    (card,) = backend.devices()
    assert (card.utilization, card.temperature, card.total) == (None, None, 8 * GiB)  # memory still reported
    backend.devices()
    assert module.calls == 2  # each gauge raised once and is not asked again
    fake("cuda", FakeTorchModule([FakeCard("old torch")]))  # no such functions at all
    assert backends.CudaBackend().devices()[0].utilization is None
    cpu = backends.CpuBackend().devices()[0]
    assert (cpu.utilization, cpu.temperature) == (None, None)
    (simulated,) = backends.simulated_backends([SimulatedDevice(GiB)])[0].devices()
    assert (simulated.utilization, simulated.temperature) == (None, None)  # like a backend that cannot tell


def test_rocm_is_named_so_and_its_dtypes_come_from_the_gfx_architecture(fake):
    cards = [
        FakeCard("MI300X", arch="gfx942:sramecc+:xnack-"),
        FakeCard("RX 7900 XTX", arch="gfx1100"),
        FakeCard("RX 6800", arch="gfx1030"),
    ]
    fake("cuda", FakeTorchModule(cards), hip="6.2")
    backend = backends.CudaBackend()
    assert backend.name == "rocm"
    mi300, rx7900, rx6800 = backend.devices()
    assert mi300.dtypes == ("fp32", "fp16", "bf16", "fp8") and mi300.kind == "rocm"
    assert rx7900.dtypes == ("fp32", "fp16", "bf16")  # RDNA3 (gfx11) computes in bf16
    assert rx6800.dtypes == ("fp32", "fp16")  # RDNA2 (gfx10) does not


def test_without_mem_get_info_free_memory_is_the_total_less_what_torch_reserved(fake):
    fake("xpu", FakeTorchModule([FakeCard("Arc A770", total=16 * GiB, reserved=3 * GiB)], with_mem_get_info=False))
    (arc,) = backends.TorchModuleBackend("xpu", "xpu").devices()
    assert (arc.total, arc.free, arc.native, arc.kind) == (16 * GiB, 13 * GiB, "xpu:0", "xpu")
    assert arc.used_by_others == 0 and arc.error is None


@pytest.mark.parametrize("module", ["npu", "mlu"])
def test_npu_and_mlu_share_the_cuda_style_probe(fake, module):
    fake(module, FakeTorchModule([FakeCard("card 0"), FakeCard("card 1")]))
    found = backends.TorchModuleBackend(module, module).devices()
    assert [d.native for d in found] == [f"{module}:0", f"{module}:1"] and all(d.error is None for d in found)


def test_a_card_that_fails_is_reported_with_its_error_and_the_others_still_are(fake):
    cards = [FakeCard("lost", fails="name"), FakeCard("sick", fails="memory"), FakeCard("fine")]
    fake("cuda", FakeTorchModule(cards))
    lost, sick, fine = backends.CudaBackend().devices()
    assert lost.error == "RuntimeError: device is lost" and lost.total is None
    assert sick.error.startswith("RuntimeError: CUDA error") and sick.name == "sick" and sick.free is None
    assert fine.error is None and fine.total == 8 * GiB


def test_a_module_with_no_device_is_not_available(fake):
    fake("cuda", FakeTorchModule([]))
    assert not backends.CudaBackend().available()
    fake("xpu", None)  # a torch built without XPU has no torch.xpu at all
    assert not backends.TorchModuleBackend("xpu", "xpu").available()


def test_mps_reports_the_shared_memory_with_or_without_recommended_max_memory(monkeypatch):
    calls = {"current_allocated_memory": lambda: GiB, "driver_allocated_memory": lambda: 3 * GiB}
    monkeypatch.setattr(torch.backends, "mps", types.SimpleNamespace(is_available=lambda: True), raising=False)
    monkeypatch.setattr(torch, "mps", types.SimpleNamespace(recommended_max_memory=lambda: 20 * GiB, **calls))
    backend = backends.MpsBackend()
    assert backend.available()
    (mps,) = backend.devices()
    assert (mps.total, mps.free, mps.torch_allocated, mps.native) == (20 * GiB, 17 * GiB, GiB, "mps")
    monkeypatch.setattr(torch, "mps", types.SimpleNamespace(**calls))  # older torch: no recommended_max_memory
    (older,) = backend.devices()
    assert older.total == psutil.virtual_memory().total


def test_directml_lists_its_devices_without_memory_figures(monkeypatch):
    module = types.ModuleType("torch_directml")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_directml", None)
    module.device_count = lambda: 2
    module.device_name = lambda index: f"Radeon {index}"
    monkeypatch.setitem(sys.modules, "torch_directml", module)
    backends.installed.cache_clear()
    try:
        backend = backends.DirectMLBackend()
        assert backend.available()
        found = backend.devices()
        assert [(d.name, d.native, d.total, d.free) for d in found] == [
            ("Radeon 0", "privateuseone:0", None, None),
            ("Radeon 1", "privateuseone:1", None, None),
        ]
    finally:
        backends.installed.cache_clear()


def test_the_inventory_numbers_several_backends_and_survives_one_that_raises(fake):
    fake("cuda", FakeTorchModule([FakeCard("RTX 3090"), FakeCard("RTX 3060")]))
    fake("xpu", FakeTorchModule([FakeCard("Arc B580")]))

    class Broken(backends.DeviceBackend):
        name = "npu"

        def available(self) -> bool:
            return True

        def devices(self) -> list:
            raise RuntimeError("driver version mismatch")

        def reset_peaks(self) -> None:
            raise RuntimeError("driver version mismatch")

    probes = [backends.CudaBackend(), backends.TorchModuleBackend("xpu", "xpu"), Broken(), backends.CpuBackend()]
    snapshot = DeviceInventory(backends=probes).snapshot()
    gpus = [(d.id, d.name) for d in snapshot.devices if d.id.startswith("gpu")]
    assert gpus == [("gpu:0", "RTX 3090"), ("gpu:1", "RTX 3060"), ("gpu:2", "Arc B580")]
    assert snapshot.get("cpu") is not None
    assert any("driver version mismatch" in e for e in snapshot.errors)
