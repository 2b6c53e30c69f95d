"""The GGUF benchmark's table (from made-up rounds: no ComfyUI, no model is loaded): a row per model and budget,
medians with their ranges, each step over the fp16 model's in the same round, and ComfyUI's rows over all rounds."""

from __future__ import annotations

from tools.bench.gguf_step import COMFYUI, OURS, table

GiB = 1024**3


def _budget(name: str, scale: float) -> dict:
    factor = {"fp16": 1.0, "GGUF Q8_0": 2.0, "GGUF Q4_0": 3.0}
    steps = {label: [f * scale * s for s in (1.0, 1.1, 0.9)] for label, f in factor.items()}
    steps |= {label: [0.5, 0.5, 0.5] for label in COMFYUI}
    return {
        "budget": name,
        "placed": {label: {"budget": name, "resident": GiB // 2} for label in OURS},
        "step_s": steps,
        "moved": {label: [GiB // 4] * 3 for label in [*OURS, *COMFYUI]},
        "faults": {label: [1000, 2000, 3000] for label in [*OURS, *COMFYUI]},
    }


def test_the_gguf_table_gives_each_step_against_fp16_in_the_same_round():
    sizes = dict.fromkeys([*OURS, *COMFYUI], GiB)
    text = table({"sizes": sizes, "budgets": [_budget("all", 1.0), _budget("50%", 2.0)]})
    lines = text.splitlines()
    assert len(lines) == 2 + 2 * len(OURS) + len(COMFYUI)
    assert all(line.count("|") == lines[1].count("|") for line in lines)
    q8_0 = "| GGUF Q8_0 | all (all) | 1.000 GiB | 0.500 GiB | 0.250 GiB | 2000 ms (1800-2200) | 2.00x (2.00-2.00) |"
    assert lines[3].startswith(q8_0)
    assert "| GGUF Q4_0 | 50% (50%) | 1.000 GiB | 0.500 GiB | 0.250 GiB | 6000 ms (5400-6600) | 3.00x" in text
    # ComfyUI's rows: every round of every budget, over the fp16 model fully resident in the same round.
    comfyui = "| ComfyUI, default dtype (CPU) | - (CPU, every budget's rounds) | 1.000 GiB | - | - | 500 ms (500-500)"
    assert lines[-2].startswith(comfyui)
    assert "| 0.50x (0.45-0.56) (against fp16, all) | 2 k |" in lines[-1]
