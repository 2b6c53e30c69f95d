"""The host-cost benchmark's own arithmetic (``tools/bench/host.py``): its call counter, the figures per layer call and
the table with what misses its target. ``python -m tools.bench.host --quick`` runs the whole tool on a small UNet."""

from __future__ import annotations

import heapq
import json
import time
from pathlib import Path

from tools.bench.host import per_layer
from tools.bench.host_counters import BackendTime, Calls
from tools.bench.host_report import SHARES, from_json, table


def _inner() -> int:
    return 1


def _outer() -> int:
    return _inner() + _inner()


def test_calls_are_counted_in_the_files_asked_for_and_booked_to_the_outermost():
    calls = Calls((str(Path(__file__)),))
    with calls.counting():
        _outer()
        len("not counted: a builtin")
    assert calls.total == 3 and calls.by_root == {"_outer": 3}
    assert calls.by_function[f"{Path(__file__).name}:_inner"] == 2


def test_what_an_excluded_file_calls_is_not_counted():
    """The simulated backend's modules are excluded, and so is what they call (a simulated tensor's shape asks a
    function of ours that no real GPU's tensor would)."""
    calls = Calls((str(Path(__file__)),), excluded=(heapq.__file__,))
    with calls.counting():
        heapq.nsmallest(1, [2, 1, 3], key=lambda value: _inner() + value)  # heapq.py calls back into this file
        _inner()
    assert calls.total == 1 and calls.by_function == {f"{Path(__file__).name}:_inner": 1}


class _Backend:
    def copy(self) -> int:
        time.sleep(0.02)
        return self.wait() + 1

    def wait(self) -> int:
        time.sleep(0.01)
        return 1


def test_the_simulated_backends_time_is_measured_once_per_outer_call_and_its_methods_restored():
    plain = _Backend.copy
    with BackendTime().watching(_Backend) as backend:
        assert _Backend().copy() == 2  # copy calls wait: timed once, by copy
        first = backend.seconds
        _Backend().wait()
    assert 0.03 <= first < 0.2 and 0.01 <= backend.seconds - first < 0.1
    assert _Backend.copy is plain


def _side(calls: dict[float, int], seconds: dict[float, float], streamed: dict[float, int], **extra) -> dict:
    return {
        share: {"calls": calls[share], "forward_s": seconds[share], "layers": 100, "streamed": streamed[share], **extra}
        for share in (1.0, *SHARES)
    }


def test_figures_per_layer_call_and_the_misses():
    streamed = {1.0: 0, 0.0: 100, 0.25: 50, 0.5: 20}
    ours = _side({1.0: 400, 0.0: 3000, 0.25: 1200, 0.5: 720}, {1.0: 1.0, 0.0: 1.2, 0.25: 1.01, 0.5: 1.0}, streamed)
    for share, figures in ours.items():
        figures["once_calls"], figures["once_s"] = (6000 if share == 0.0 else 100), 0.01
        figures.update(group_copies=int(share * 40), groups=int(share * 40), host_waits=0)
    comfy = _side({1.0: 5000, 0.0: 6000, 0.25: 5500, 0.5: 5200}, {1.0: 1.0, 0.0: 1.1, 0.25: 1.05, 0.5: 1.02}, streamed)
    for figures in comfy.values():
        figures["layer_own_calls"] = 200
    rows = per_layer(ours, comfy)
    assert rows[1.0] == {"ours_calls": 4.0, "comfy_calls": 2.0}
    assert rows[0.0]["ours_calls"] == 30.0 and rows[0.0]["comfy_calls"] == 12.0
    assert rows[0.25]["ours_calls"] == 20.0 and abs(rows[0.25]["ours_us"] - 200.0) < 1e-6
    results = {"sd15": {"ours": ours, "comfy": comfy, "per_layer": rows}}
    text, misses = table(results)
    assert table(from_json(json.loads(json.dumps(results)))) == (text, misses)  # as tools/bench/run_all.py reads it
    assert (
        "| sd15 | 25% | 50 / 50 of 100 | 20.0 / 12.0 (<= 20) | 200.0 / 1000.0 | 100 (<= 5000), 10 ms | 10 / 10, 0 |"
        in text
    )
    assert misses == [
        "sd15 at 0%: host time per streamed layer call above ComfyUI's",
        "sd15 at 0%: 6000 calls once a sampling call",
        "sd15 at all (resident): 4.0 calls a layer call",
    ]
