"""The peak of an interval read from a device's peak counter the pack does not reset (``DEVICE_CONTROL_PEAKS``):
the arithmetic on its own, then through the inventory over a simulated GPU, whose counter behaves as torch's, with
the VRAM Report's measure and the profile's side by side."""

from __future__ import annotations

import logging

import torch

from core.devices.backends import CpuBackend, SimulatedBackend
from core.devices.inventory import DeviceInventory
from core.devices.peaks import KEEP, PEAKS_ENV, RESET, Mark, Peak, interval_peak, peaks_from_env
from core.devices.sim.device import SimulatedDevice
from core.monitor.report import build_report

MiB = 1024**2


def test_a_counter_that_rose_is_the_intervals_exact_peak():
    assert interval_peak(Mark(5 * MiB, 1 * MiB), Mark(9 * MiB, 2 * MiB)) == Peak(9 * MiB)
    assert interval_peak(None, Mark(9 * MiB, 2 * MiB), Peak(3 * MiB, exact=False)) == Peak(9 * MiB)  # it started


def test_no_new_high_gives_a_lower_bound_marked_not_exact():
    start, end = Mark(9 * MiB, 2 * MiB), Mark(9 * MiB, 3 * MiB)
    assert interval_peak(start, end) == Peak(3 * MiB, exact=False)
    assert interval_peak(start, end, Peak(6 * MiB)) == Peak(6 * MiB, exact=False)  # a node's peak inside it
    assert interval_peak(Mark(9 * MiB, 4 * MiB), Mark(9 * MiB, 1 * MiB)) == Peak(4 * MiB, exact=False)
    # the lower bound reaches the counter, the upper bound: known exactly after all
    assert interval_peak(start, end, Peak(9 * MiB, exact=False)) == Peak(9 * MiB)


def test_a_counter_someone_else_reset_gives_at_least_what_it_counts_since():
    assert interval_peak(Mark(9 * MiB, 2 * MiB), Mark(5 * MiB, 1 * MiB)) == Peak(5 * MiB, exact=False)
    assert interval_peak(Mark(9 * MiB, 7 * MiB), Mark(5 * MiB, 1 * MiB)) == Peak(7 * MiB, exact=False)


def test_the_setting_defaults_to_keep_and_a_typo_is_logged_with_the_fix(caplog):
    assert peaks_from_env({}) == KEEP and peaks_from_env({PEAKS_ENV: " Reset "}) == RESET
    assert peaks_from_env({PEAKS_ENV: "keep"}) == KEEP
    with caplog.at_level(logging.ERROR, logger="device_control"):
        assert peaks_from_env({PEAKS_ENV: "rest"}) == KEEP
    assert "[Device Control] DEVICE_CONTROL_PEAKS='rest' is neither keep nor reset" in caplog.text
    assert "DEVICE_CONTROL_PEAKS=reset for exact peaks" in caplog.text


class CountingBackend(SimulatedBackend):
    """The simulated GPU's backend, counting the resets of its peak counter."""

    def __init__(self, devices) -> None:
        super().__init__(devices)
        self.resets = 0

    def reset_peaks(self) -> None:
        self.resets += 1
        super().reset_peaks()


def inventory_of(gpu: SimulatedDevice, mode: str | None = None) -> tuple[DeviceInventory, CountingBackend]:
    backend = CountingBackend([gpu])
    if mode is None:
        return DeviceInventory(backends=[CpuBackend()], extra=[backend]), backend
    return DeviceInventory(backends=[CpuBackend()], extra=[backend], peak_mode=mode), backend


def spike(gpu: SimulatedDevice, size: int) -> None:
    """Hold ``size`` bytes on ``gpu`` for a moment."""
    scratch = gpu.place(torch.zeros(size // 4))
    del scratch


def test_by_default_neither_a_report_nor_a_profile_reading_resets_a_counter(monkeypatch):
    monkeypatch.delenv(PEAKS_ENV, raising=False)
    gpu = SimulatedDevice(64 * MiB)
    inventory, backend = inventory_of(gpu)
    assert inventory.peak_mode == KEEP
    spike(gpu, 8 * MiB)
    inventory.take_reading()
    inventory.snapshot()
    inventory.reset_peaks()  # what the VRAM Report does after each report
    inventory.take_reading()
    assert backend.resets == 0 and gpu.peak_allocated() == 8 * MiB  # what another tool reads is untouched


def test_the_profiles_node_peaks_are_exact_on_a_new_high_and_at_least_otherwise():
    gpu = SimulatedDevice(64 * MiB)
    inventory, _backend = inventory_of(gpu, KEEP)
    held = gpu.place(torch.zeros(MiB // 4))
    inventory.take_reading()  # a node starts
    spike(gpu, 8 * MiB)
    assert inventory.take_reading()[1]["gpu:0"] == Peak(9 * MiB)  # a new high: exact
    inventory.take_reading()  # the next node starts
    spike(gpu, 4 * MiB)  # below the high: the counter does not move
    assert inventory.take_reading()[1]["gpu:0"] == Peak(MiB, exact=False)  # at least what it held
    del held


def test_the_reports_peak_counts_the_profiles_readings_inside_it_and_says_when_it_is_a_lower_bound():
    gpu = SimulatedDevice(64 * MiB)
    inventory, _backend = inventory_of(gpu, KEEP)
    spike(gpu, 16 * MiB)
    inventory.reset_peaks()  # a report: its next interval starts here, above nothing the counter lacks
    held = gpu.place(torch.zeros(2 * MiB // 4))
    inventory.take_reading()  # a node starts, inside the report's interval
    info = inventory.snapshot().get("gpu:0")
    assert (info.peak_allocated, info.peak_bounded) == (2 * MiB, True)
    text = build_report(inventory.snapshot(), [], None).to_text()
    assert "peak since the previous report ≥ 2.00 MiB (not a new high; DEVICE_CONTROL_PEAKS=reset" in text
    del held
    inventory.take_reading()  # the node ends: its peak, at least 2 MiB, is carried into the report's
    assert inventory.snapshot().get("gpu:0").peak_allocated == 2 * MiB
    spike(gpu, 20 * MiB)  # a new high: exact again
    info = inventory.snapshot().get("gpu:0")
    assert (info.peak_allocated, info.peak_bounded) == (20 * MiB, False)
    assert "peak since the previous report 20.00 MiB;" in build_report(inventory.snapshot(), [], None).to_text()


def test_a_reading_that_began_before_the_report_is_not_carried_into_its_interval():
    gpu = SimulatedDevice(64 * MiB)
    inventory, _backend = inventory_of(gpu, KEEP)
    inventory.take_reading()
    spike(gpu, 16 * MiB)  # before the report
    inventory.reset_peaks()
    assert inventory.take_reading()[1]["gpu:0"] == Peak(16 * MiB)  # the node's own peak, exact
    assert inventory.snapshot().get("gpu:0").peak_allocated == 0  # not the report's: it was before it


def test_reset_mode_keeps_exact_per_interval_peaks_by_resetting_the_counters():
    gpu = SimulatedDevice(64 * MiB)
    inventory, backend = inventory_of(gpu, RESET)
    held = gpu.place(torch.zeros(MiB // 4))
    spike(gpu, 16 * MiB)
    inventory.reset_peaks()
    spike(gpu, 4 * MiB)
    assert inventory.take_reading()[1]["gpu:0"] == Peak(5 * MiB)  # exact, though below the earlier high
    assert inventory.take_reading()[1]["gpu:0"] == Peak(MiB)
    info = inventory.snapshot().get("gpu:0")
    assert (info.peak_allocated, info.peak_bounded) == (5 * MiB, False)  # the report's counts the readings'
    assert backend.resets == 3 and gpu.peak_allocated() == MiB
    del held
