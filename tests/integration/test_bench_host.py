"""The host-cost benchmark runs end to end: its real worker, in a fresh process of the runtime, times ComfyUI's cast
path and the ring on the same layers, and the table comes out with both figures and their ratio. The benchmark runs
against the primary ComfyUI (``tools/bench.py``), so this test runs in that version's pass."""

from __future__ import annotations

from functools import partial

from tests.passes import ONCE
from tools.bench import aggregate, worker
from tools.bench_tables import host


@ONCE
def test_the_host_section_times_both_casts_on_the_same_layers_and_makes_its_table():
    small = partial(worker, "48", "3")  # 48 layers, 3 passes: the real worker, small
    raw, table = host(1, {}, small, aggregate)
    run = raw[0]
    assert run["layers"] == 48 and run["groups"] == 6  # eight layers a group, as SDXL's average at 1.5 GB
    assert set(run["host_us_per_layer"]) == {"ComfyUI cast", "ours, ring"}
    assert run["pass_s"]["plain"] > 0 and run["ratio"] > 0
    row = table.splitlines()[2]
    assert row.startswith("| 48 | 6 | ") and row.endswith(" |") and row.count(" us") >= 2
