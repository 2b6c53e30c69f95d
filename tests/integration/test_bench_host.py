"""The host-cost benchmark runs end to end: its real tool, in a fresh process of the runtime, places a small
SD1.5-shaped UNet through Move To GPU's own path on a simulated GPU and samples it with ComfyUI's sampler, loads the
same tree through ComfyUI's low-VRAM path beside it, and prints both sides' calls per streamed layer call and once
per sampling call, with what misses its target. The benchmark runs against the primary ComfyUI
(``tools/bench/run_all.py``), so this test runs in that version's pass."""

from __future__ import annotations

from tests.passes import ONCE
from tools.bench.host_report import from_json, table
from tools.bench.run_all import worker


@ONCE
def test_the_host_benchmark_counts_both_sides_on_the_same_unet_and_makes_its_table():
    raw = worker("--quick", module="tools.bench.host")
    results = from_json(raw)["quick"]
    assert results["ours"][0.25]["streamed"] > 0 and results["comfy"][0.25]["streamed"] > 0  # both stream
    assert results["per_layer"][0.25]["ours_calls"] > 0 and results["per_layer"][0.25]["comfy_calls"] > 0
    assert results["ours"][0.25]["once_calls"] > 0
    # A steady forward copies each group once (the last copies the next step's first, ahead): issue 57, item 10.
    for share in (0.0, 0.25, 0.5):
        ours = results["ours"][share]
        assert ours["groups"] > 0 and ours["group_copies"] == ours["groups"], (share, ours)
        assert ours["host_waits"] == 0, (share, ours)  # from locked slabs the host never waits for the device
    text, _misses = table(from_json(raw))
    rows = [line for line in text.splitlines() if line.startswith("| quick |")]
    assert len(rows) == 4 and all(row.endswith(" |") for row in rows)
