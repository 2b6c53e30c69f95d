"""The load benchmarks' tables: pairs alternate who goes first, every model gets a row per loader, and the
targets are judged from the medians (with a stand-in worker: no ComfyUI, no model is loaded)."""

from __future__ import annotations

from tools.bench.loads import LOAD_RULE, SPLIT_MODELS, paired, settle_page_cache, split_loaders, warm_page_cache
from tools.bench.run_all import aggregate

GiB = 1024**3


def test_pairs_alternate_who_goes_first_and_keep_comfyui_as_the_reference():
    calls: list[str] = []
    pairs = paired(3, lambda who: calls.append(who) or {"who": who})
    assert calls == ["comfyui", "ours", "ours", "comfyui", "comfyui", "ours"]
    assert all(list(pair) == ["comfyui", "ours"] and pair["ours"]["who"] == "ours" for pair in pairs)


def test_the_split_loaders_table_has_a_row_per_model_and_loader_and_judges_the_targets(tmp_path):
    paths = {}
    for model in SPLIT_MODELS:
        for label in model.files:
            paths[label] = tmp_path / f"{len(paths)}.safetensors"
            paths[label].write_bytes(b"\0" * 64)
    asked: list[tuple[str, ...]] = []
    floors: list[tuple[str, ...]] = []

    def worker(*args: str, module: str = "tools.bench.workers") -> dict:
        if module == "tools.bench.floor":
            floors.append(args)
            return {"floor": 6.0, "cores": 2}
        asked.append(args)
        ours = args[1] == "ours"
        return {
            "seconds": 4.0 if ours else 10.0,
            "baseline": GiB,
            "peak": GiB + (int(1.05 * 8 * GiB) if ours else 16 * GiB),
            "resident": 8 * GiB,
            "stored": {"float8_e4m3fn": 8 * GiB},
        }

    raw, table = split_loaders(2, paths, worker, aggregate)
    lines = table.splitlines()
    rows = [line for line in lines[2:] if line.startswith("| ")]
    assert lines[1] == LOAD_RULE and lines[0].count("|") == LOAD_RULE.count("|")
    assert len(rows) == 3 * len(SPLIT_MODELS) and all(row.count("|") == LOAD_RULE.count("|") for row in rows)
    assert "| floor: read + write + convert, processor time / 2 cores | 6.0 s | 0.60x |" in rows[2]
    # The floor is measured once per model, after its pairs, for the resident bytes of our runs.
    assert [args[:2] for args in floors] == [("float8_e4m3fn", str(8 * GiB))] * len(SPLIT_MODELS)
    assert "| Device Control | 4.0 s (4.0-4.0) | 0.40x (0.40-0.40) | 8.40 GiB (8.40-8.40) | 8.00 GiB" in rows[1]
    assert "| ComfyUI | 10.0 s (10.0-10.0) | 1.00x (1.00-1.00) | 16.00 GiB" in rows[0] and rows[0].endswith(
        "| 2.00 (2.00-2.00) |"
    )
    verdicts = [line for line in lines if line.startswith("- ")]
    assert len(verdicts) == len(SPLIT_MODELS)
    assert all("time 0.40x" in v and ": met; the floor is 0.60x" in v for v in verdicts)
    assert all(
        "the target is below it on this machine; ours is 0.67x the floor); peak RSS 1.05x" in v for v in verdicts
    )
    assert all("every run: yes." in v for v in verdicts)
    assert [args[:4] for args in asked[:2]] == [
        ("split", "comfyui", SPLIT_MODELS[0].kind, SPLIT_MODELS[0].dtype),
        ("split", "ours", SPLIT_MODELS[0].kind, SPLIT_MODELS[0].dtype),
    ]
    assert asked[2][1] == "ours" and asked[3][1] == "comfyui"  # the second run starts with ours
    assert [r["model"] for r in raw] == [m.label for m in SPLIT_MODELS] and len(raw[0]["runs"]) == 2


def test_a_file_too_large_for_the_page_cache_is_left_out(tmp_path, monkeypatch):
    small, large = tmp_path / "small", tmp_path / "large"
    small.write_bytes(b"x" * 1000)
    with open(large, "wb") as handle:
        handle.truncate(10**6)  # sparse
    monkeypatch.setattr("tools.bench.loads._available_bytes", lambda: 2 * 10**5)
    assert warm_page_cache([small, large]) == [large]


def test_before_a_run_the_other_files_and_a_file_too_large_to_cache_are_dropped_and_the_rest_read(
    tmp_path, monkeypatch
):
    small, large, other = tmp_path / "small", tmp_path / "large", tmp_path / "other"
    small.write_bytes(b"x" * 1000)
    other.write_bytes(b"y" * 1000)
    with open(large, "wb") as handle:
        handle.truncate(10**6)  # sparse
    dropped, read = [], []
    monkeypatch.setattr("tools.bench.loads._available_bytes", lambda: 2 * 10**5)
    monkeypatch.setattr("tools.bench.loads.drop_from_page_cache", dropped.append)
    monkeypatch.setattr("tools.bench.loads.warm_page_cache", read.append)
    settle_page_cache([small, large], [small, large, other, tmp_path / "absent"])
    assert dropped == [large, other] and read == [[small, large]]  # (warm_page_cache leaves the large one out)
