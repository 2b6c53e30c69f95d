"""The memory profile's recorder, driven as the pack drives it (node started, finished, cached, prompt ended) over
a simulated GPU whose books move as a small model is placed and offloaded; and the inventory's per-node peaks
inside the VRAM Report's longer measure."""

from __future__ import annotations

import threading
from dataclasses import replace

import torch

from core.devices.backends import CpuBackend, simulated_backends
from core.devices.inventory import DeviceInventory
from core.devices.peaks import KEEP, RESET, Peak
from core.devices.sim.device import SimulatedDevice
from core.monitor import profile as profiling
from core.monitor.profile import Recorder
from core.monitor.readings import Reading, model_events, streamed_events

MiB = 1024**2


class Books:
    """A simulated GPU in an inventory (its peak counters kept, unless ``peak_mode`` says reset), and a model
    whose residency the recorder reads."""

    def __init__(self, peak_mode: str = KEEP) -> None:
        self.gpu = SimulatedDevice(64 * MiB)
        self.inventory = DeviceInventory(
            backends=[CpuBackend()], extra=simulated_backends([self.gpu]), peak_mode=peak_mode
        )
        self.model = torch.nn.Linear(1024, 1024)  # 4 MiB of weights in fp32
        self.held: torch.Tensor | None = None

    def read(self) -> Reading:
        snapshot, peaks = self.inventory.take_reading()
        used = {info.id: info.torch_allocated or 0 for info in snapshot.devices if info.id}
        resident = {"cpu": 4 * MiB} if self.held is None else {"gpu:0": self.held.nbytes}
        bounded = frozenset(device for device, peak in peaks.items() if not peak.exact)
        values = {device: peak.value for device, peak in peaks.items()}
        return Reading(used, values, {"m": ("Linear", resident)}, bounded=bounded)

    def recorder(self, clock=None) -> Recorder:
        return Recorder(self.read) if clock is None else Recorder(self.read, clock=clock)


def test_each_node_gets_its_time_memory_peak_and_model_events():
    books = Books()
    ticks = iter(range(100))
    recorder = books.recorder(clock=lambda: float(next(ticks)))
    recorder.prompt_started("p1")
    recorder.node_started("p1", "4", "Move", "Move To GPU")
    books.held = books.gpu.place(books.model.weight.detach())  # the node places the weight on the GPU
    recorder.node_finished("p1", "4")
    recorder.node_started("p1", "7", "Sampler", "KSampler")
    scratch = books.gpu.place(torch.zeros(8 * MiB // 4))  # 8 MiB of activations, freed before the end
    del scratch
    recorder.node_finished("p1", "7")
    recorder.node_cached("p1", "2", "Loader", "Load")
    recorder.node_started("p1", "9", "Offload", "Offload To CPU")
    books.held = None
    recorder.node_finished("p1", "9")
    recorder.prompt_ended("p1", "success")
    data = recorder.profile("p1")
    move, sampler, cached, offload = data["nodes"]
    assert data["status"] == "success" and data["prompt_id"] == "p1"
    assert (
        move["status"] == "executed"
        and move["wall"] > 0
        and move["after"]["gpu:0"] - move["before"]["gpu:0"] == 4 * MiB
    )
    assert [(e["kind"], e["bytes"]) for e in move["events"]] == [("loaded", 4 * MiB)]
    assert sampler["peak"]["gpu:0"] == 12 * MiB and sampler["after"]["gpu:0"] == 4 * MiB  # the allocator's peak
    assert sampler["peak_bounded"] == [] and move["peak_bounded"] == []  # each set a new high: exact
    assert cached["status"] == "cached" and cached["peak"] == {}
    assert [(e["kind"], e["bytes"]) for e in offload["events"]] == [("offloaded", 4 * MiB)]
    assert offload["after"]["gpu:0"] == 0
    assert offload["peak"]["gpu:0"] == 4 * MiB and offload["peak_bounded"] == ["gpu:0"]  # no new high: at least
    assert data["heaviest"] == {"node": "7", "device": "gpu:0"} and data["recording"] > 0
    # What each node did: its own peak above the level it started at, on the device whose books it changed.
    assert (move["rise"]["gpu:0"], move["device"]) == (4 * MiB, "gpu:0")
    assert (sampler["rise"]["gpu:0"], sampler["device"]) == (8 * MiB, "gpu:0")
    assert (offload["rise"]["gpu:0"], offload["device"]) == (0, "gpu:0")  # it lowered the level: no rise
    assert recorder.latest().summary() == "heaviest node so far: KSampler (7), +8.00 MiB on gpu:0"
    table = recorder.markdown("p1")
    assert "| KSampler (7) | Sampler | executed |" in table and "| Load (2) | Loader | cached |" in table
    assert "| +8.00 MiB on gpu:0 |" in table
    assert "| Offload To CPU (9) | Offload | executed |" in table and "| ≥ 4.00 MiB |" in table


def test_reset_mode_the_vram_reports_peak_still_counts_the_peaks_taken_per_node():
    books = Books(peak_mode=RESET)
    books.inventory.reset_peaks()
    scratch = books.gpu.place(torch.zeros(16 * MiB // 4))
    del scratch
    assert books.inventory.take_reading()[1]["gpu:0"] == Peak(16 * MiB)  # one node's peak
    snapshot, peaks = books.inventory.take_reading()
    assert peaks["gpu:0"] == Peak(0) and snapshot.get("gpu:0").peak_allocated == 16 * MiB  # started again, counted
    assert books.inventory.snapshot().get("gpu:0").peak_allocated == 16 * MiB  # the report's: since it reset
    books.inventory.reset_peaks()
    assert books.inventory.snapshot().get("gpu:0").peak_allocated == 0


def test_a_peak_known_only_as_a_lower_bound_reads_at_least_in_the_summary_and_the_table():
    readings = iter(
        [
            Reading({"gpu:0": MiB}, {"gpu:0": MiB}, {}),
            Reading({"gpu:0": 2 * MiB}, {"gpu:0": 2 * MiB}, {}, bounded=frozenset({"gpu:0"})),
        ]
    )
    recorder = Recorder(lambda: next(readings))
    recorder.node_started("p", "3", "Decode", "VAE Decode")
    recorder.node_finished("p", "3")
    node = recorder.profile("p")["nodes"][0]
    assert (node["peak"], node["peak_bounded"]) == ({"gpu:0": 2 * MiB}, ["gpu:0"])
    assert recorder.latest().summary() == "heaviest node so far: VAE Decode (3), ≥ +1.00 MiB on gpu:0"
    table = recorder.markdown("p")
    assert "| VAE Decode (3) | Decode | executed | " in table and "| ≥ 2.00 MiB |" in table


def test_the_heaviest_mark_goes_to_the_largest_rise_alone_and_a_node_without_gpu_work_is_on_the_cpu():
    """A node that changed no accelerator's books computed on the CPU; two nodes that raised memory equally, or
    none raising any, leave no node marked (the order they ran in decides nothing)."""

    def run(rises: list[tuple[int, int]]) -> dict:
        readings = []
        for gpu, cpu in rises:
            readings += [Reading({"gpu:0": MiB, "cpu": MiB}, {"gpu:0": MiB}, {})]
            readings += [Reading({"gpu:0": MiB, "cpu": MiB + cpu}, {"gpu:0": MiB + gpu}, {})]
        feed = iter(readings)
        recorder = Recorder(lambda: next(feed))
        for index in range(len(rises)):
            recorder.node_started("p", str(index), "N", f"N{index}")
            recorder.node_finished("p", str(index))
        return recorder.profile("p")

    data = run([(0, 0), (2 * MiB, 0), (0, 0)])
    assert [n["device"] for n in data["nodes"]] == ["cpu", "gpu:0", "cpu"]
    assert data["heaviest"] == {"node": "1", "device": "gpu:0"}
    assert run([(2 * MiB, 0), (2 * MiB, 0)])["heaviest"] is None  # a tie
    assert run([(0, 0), (0, 0)])["heaviest"] is None  # nothing raised
    on_cpu = run([(0, 3 * MiB), (0, MiB)])
    assert on_cpu["heaviest"] == {"node": "0", "device": "cpu"} and on_cpu["nodes"][0]["rise"]["cpu"] == 3 * MiB
    feed = iter([Reading({}, {}, {})] * 2)
    recorder = Recorder(lambda: next(feed))
    recorder.prompt_started("w", workflow="wf-1")
    assert recorder.profile("w")["workflow"] == "wf-1"
    assert recorder.latest().summary() == "heaviest node so far: none (no node has run yet)"


def test_a_node_that_never_finished_failed_and_only_the_last_twenty_prompts_are_kept():
    books = Books()
    recorder = books.recorder()
    recorder.node_started("p0", "1", "Bad", "Bad node")
    recorder.prompt_ended("p0", "error")
    assert recorder.profile("p0")["nodes"][0]["status"] == "failed"
    for index in range(1, profiling.KEEP + 5):
        recorder.prompt_started(f"p{index}")
    kept = recorder.prompt_ids()
    assert len(kept) == profiling.KEEP and kept[-1] == f"p{profiling.KEEP + 4}" and recorder.profile("p0") is None
    assert recorder.profile("p1") is None and recorder.profile()["prompt_id"] == kept[-1]
    assert recorder.profile(kept[0])["status"] == "interrupted"  # a later prompt started: it never ended


def test_a_profile_stays_bounded_and_readers_never_see_it_half_written(monkeypatch):
    monkeypatch.setattr(profiling, "MAX_NODES", 5)
    books = Books()
    recorder = books.recorder()
    reads: list[int] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            data = recorder.profile()
            reads.append(0 if data is None else len(data["nodes"]))

    reader = threading.Thread(target=read)
    reader.start()
    for index in range(8):
        recorder.node_started("p", str(index), "N", "N")
        recorder.node_finished("p", str(index))
    stop.set()
    reader.join()
    data = recorder.profile("p")
    assert len(data["nodes"]) == 5 and data["nodes_left_out"] == 3 and max(reads) <= 5


def test_model_events_name_loads_moves_and_offloads():
    before = {"a": ("A", {"cpu": 10}), "b": ("B", {"gpu:0": 6, "cpu": 4}), "c": ("C", {"gpu:0": 5})}
    after = {"a": ("A", {"gpu:0": 10}), "b": ("B", {"gpu:0": 3, "gpu:1": 7}), "d": ("D", {"cpu": 2})}
    events = {e.key: (e.kind, e.bytes) for e in model_events(before, after, 1.0)}
    # C left gpu:0 while A arrived there: evicted to make room.
    assert events == {"a": ("loaded", 10), "b": ("moved", 7), "c": ("evicted", 5), "d": ("loaded", 2)}


def test_model_events_tell_partial_loads_evictions_and_streamed_bytes():
    before = {"a": ("A", {"gpu:0": 8}), "b": ("B", {"cpu": 10})}
    after = {"a": ("A", {"cpu": 8}), "b": ("B", {"gpu:0": 6, "cpu": 4})}
    events = {e.key: (e.kind, e.bytes) for e in model_events(before, after, 1.0, frozenset({"b"}))}
    assert events == {"a": ("evicted", 8), "b": ("partially loaded", 6)}
    # A model leaving while nothing arrives on its GPU was offloaded, not evicted.
    alone = model_events({"a": ("A", {"gpu:0": 8})}, {"a": ("A", {"cpu": 8})}, 1.0)
    assert [(e.kind, e.bytes) for e in alone] == [("offloaded", 8)]

    first = Reading({}, {}, after, frozenset({"b"}), {"gpu:0": 100, "gpu:1": 5})
    last = Reading({}, {}, after, frozenset({"b"}), {"gpu:0": 160, "gpu:1": 5, "cpu": 9})
    streamed = streamed_events(first, last, 2.0)
    assert [(e.kind, e.model, e.bytes, e.after) for e in streamed] == [("streamed", "B", 60, {"gpu:0": 60})]
    # Copies that stayed (a load of 6 bytes onto gpu:0) are not streaming.
    loading = Reading({}, {}, before, frozenset(), {"gpu:0": 100, "gpu:1": 5})
    assert [(e.model, e.bytes) for e in streamed_events(loading, last, 2.0)] == [("B", 54)]
    assert streamed_events(loading, replace(last, streamed={"gpu:0": 106, "gpu:1": 5}), 2.0) == []
