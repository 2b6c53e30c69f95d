"""What the benchmark sections share: the shape of a section and of a worker, and how figures are written."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

GiB = 1024**3
SD15 = "SD1.5 (synthetic, 2.0 GiB fp16)"
SDXL = "SDXL base checkpoint (sparse)"
#: Whole files the detection benchmark reads besides SD1.5: label -> (name in the layouts, file name), real
#: layouts written sparsely (no disk, reads as zeros).
DETECTED_FILES = {
    SDXL: ("sdxl_base.checkpoint.json", "bench_sdxl_base_sparse.safetensors"),
    "Flux.1 dev checkpoint (sparse)": ("flux1_dev.checkpoint.json", "bench_flux1_dev_sparse.safetensors"),
    "Wan 2.1 T2V 14B diffusion model (sparse)": (
        "wan21_t2v_14b.diffusion_model.json",
        "bench_wan21_14b_sparse.safetensors",
    ),
}
#: Runs one measurement in a fresh process and returns its JSON (``tools.bench.run_all.worker``).
Worker = Callable[..., dict]
Section = Callable[[int, dict[str, Path], Worker, Callable[[list[Any]], Any]], tuple[list[Any], str]]


def fmt_gib(value: float) -> str:
    return f"{value / GiB:.2f} GiB"


def fmt_s(value: float) -> str:
    return f"{value:.1f} s"


def fmt_ms(value: float) -> str:
    return f"{value:.1f} ms"


def fmt_ratio(value: float) -> str:
    return f"{value:.2f}x"
