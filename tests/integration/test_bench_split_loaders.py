"""The split-loaders benchmark runs end to end on small files: its real worker, in fresh processes, loads each
with ComfyUI's loader and ours, and the table comes out with a row per model and loader, and both loaders
building the same weights (so a broken benchmark, or one that compares different things, fails here). The
benchmark runs against the primary ComfyUI (``tools/bench/run_all.py``), so this test runs in that version's pass."""

from __future__ import annotations

import pytest

from tests.passes import ONCE
from tools.bench.loads import LOAD_RULE, SplitModel, split_loaders
from tools.bench.run_all import aggregate, worker

#: Small stand-ins for the benchmark's rows, with conversions on the way (fp16 -> fp8, fp32 -> fp16).
SMALL = (
    SplitModel("Wan 2.1 small diffusion model as fp16", "diffusion_model", "fp16", ("wan21",)),
    SplitModel("CLIP-L as fp8_e4m3fn", "text_encoders:stable_diffusion", "fp8_e4m3fn", ("clip_l",)),
    SplitModel("SD1.5 VAE, default dtype", "vae", "auto", ("vae",)),
)


@pytest.mark.slow
@ONCE
def test_the_split_loaders_section_runs_on_small_files_and_makes_its_table(synthetic_models):
    # Only the small files: the benchmark drops its other files from the page cache before each load, and every
    # later test of the pass would read the rest of the synthetic models (about 12 GB) from the disk again.
    small_files = {label: synthetic_models[label] for model in SMALL for label in model.files}
    raw, table = split_loaders(1, small_files, worker, aggregate, models=SMALL)
    lines = table.splitlines()
    assert lines[1] == LOAD_RULE
    rows = [line for line in lines[2:] if line.startswith("| ")]
    names = [row.split(" | ")[1].split(" / ")[0] for row in rows]
    assert [row.split(" | ")[0] for row in rows] == [f"| {model.label}" for model in SMALL for _ in range(3)]
    assert names == ["ComfyUI", "Device Control", "floor: read + write + convert, processor time"] * len(SMALL)
    verdicts = [line for line in lines if line.startswith("- ")]
    assert len(verdicts) == len(SMALL) and all(v.endswith("every run: yes.") for v in verdicts), verdicts
    for entry in raw:
        pair = entry["runs"][0]
        assert pair["ours"]["resident"] == pair["comfyui"]["resident"] > 0
        assert pair["ours"]["peak"] >= pair["ours"]["baseline"]
        # The floor's worker ran on the same files: every byte read, the resident bytes written.
        floor = entry["floor"]
        assert floor["read"]["cpu"] > 0 and floor["write"]["cpu"] >= 0 and floor["floor"] > 0
    # CLIP-L's fp16 weights become fp8: the floor converts the file's weights (no more than the model holds).
    assert 0 < raw[1]["floor"]["converted"] <= raw[1]["runs"][0]["ours"]["stored"]["float8_e4m3fn"]
