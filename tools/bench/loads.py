"""The load benchmarks: ComfyUI's loader and ours in pairs of fresh processes, the same files in the page cache.

``loader`` loads whole checkpoints; ``split_loaders`` loads a diffusion model, a text-encoder set and a VAE saved
on their own, with Load Diffusion Model / Text Encoders / VAE With Device against what ComfyUI's UNETLoader,
TripleCLIPLoader and VAELoader call. Both make the table ``load_rows`` writes: time, ratio to ComfyUI in the
same run, peak RSS above the process's baseline, the bytes the models hold, and peak / resident.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tools.bench.format import SD15, SDXL, Worker, fmt_gib, fmt_ratio, fmt_s

LOAD_HEADER = "| loader | time | ratio to ComfyUI (same run) | peak RSS above baseline | resident | peak / resident |"
LOAD_RULE = "| --- | --- | --- | --- | --- | --- | --- |"
LOADERS = (("comfyui", "ComfyUI"), ("ours", "Device Control"))
#: The design's targets for our loaders: time against ComfyUI's in the same run, peak RSS against resident bytes.
TIME_TARGET, PEAK_TARGET = 0.5, 1.1


def loader(runs: int, paths: dict[str, Path], worker: Worker, aggregate: Callable) -> tuple[list, str]:
    rows = [f"| checkpoint (loaded to CPU, default dtypes) {LOAD_HEADER}", LOAD_RULE]
    raw = []
    for label, path in ((SD15, paths[SD15]), ("SDXL (sparse, 6.5 GiB fp16)", paths[SDXL])):
        warm_page_cache([path])
        pairs = paired(runs, lambda who, path=path: worker("load", who, str(path)))
        raw.append({"file": label, "runs": pairs})
        rows += load_rows(label, pairs, aggregate)
    return raw, "\n".join(rows)


# Labels of the split files in the benchmark's paths, and the layouts they are written from (sparse).
FLUX_DIFFUSION = "Flux.1 dev diffusion model (sparse)"
CLIP_L, CLIP_G, T5XXL = "CLIP-L (sparse)", "CLIP-G (sparse)", "T5-XXL fp16 (sparse)"
VAE_16CH = "Flux / SD3 16-channel VAE (sparse)"
SPLIT_FILES = {
    FLUX_DIFFUSION: ("flux1_dev.diffusion_model.json", "bench_flux1_dev_diffusion_model_sparse.safetensors"),
    CLIP_L: ("te_clip_l.json", "bench_clip_l_sparse.safetensors"),
    CLIP_G: ("te_clip_g.json", "bench_clip_g_sparse.safetensors"),
    T5XXL: ("te_t5xxl_fp16.json", "bench_t5xxl_fp16_sparse.safetensors"),
    VAE_16CH: ("vae_flux_sd3_16ch.json", "bench_vae_16ch_sparse.safetensors"),
}


@dataclass(frozen=True)
class SplitModel:
    """One row pair of the split-loaders table: what is loaded, how, and from which of the paths."""

    label: str
    #: ``diffusion_model``, ``vae`` or ``text_encoders:<ComfyUI's CLIP type>`` (see ``bench_workers.split_load``).
    kind: str
    #: Our loaders' dtype name, the same dtype for ComfyUI (``auto``: ComfyUI's default).
    dtype: str
    files: tuple[str, ...]


SPLIT_MODELS = (
    SplitModel("Flux.1 dev diffusion model (sparse, 22.2 GiB bf16) as fp8_e4m3fn", "diffusion_model", "fp8_e4m3fn",
               (FLUX_DIFFUSION,)),
    SplitModel("SD3.5 text encoders CLIP-L + CLIP-G + T5-XXL (sparse, 10.4 GiB fp16) as fp8_e4m3fn",
               "text_encoders:sd3", "fp8_e4m3fn", (CLIP_L, CLIP_G, T5XXL)),
    SplitModel("Flux / SD3 16-channel VAE (sparse, 0.31 GiB fp32), default dtype", "vae", "auto", (VAE_16CH,)),
)  # fmt: skip

SPLIT_NOTE = (
    "Before every run the benchmark's other files are dropped from the page cache (so each load finds free memory, "
    "not cached pages the kernel must reclaim first: that cost some runs seconds) and the run's files read in, so "
    "both loaders find them cached, except a file larger than half the memory then available ({skipped}): it cannot "
    "stay cached beside the model loaded from it, and is dropped too. The files are sparse (a real layout, weights "
    "read as zeros), so reading one costs memory bandwidth, not disk. Dtypes: the Flux model in fp8_e4m3fn for both, "
    "ComfyUI's UNETLoader with `weight_dtype` fp8_e4m3fn (`load_diffusion_model(path, model_options={{'dtype': "
    "float8_e4m3fn}})`): in bf16 or fp32 the model would not fit beside the file's pages in this machine's RAM. The "
    "text encoders in fp8_e4m3fn for both: what TripleCLIPLoader builds under ComfyUI's `--fp8_e4m3fn-text-enc` "
    "(`load_clip([3 files], model_options={{'dtype': float8_e4m3fn}})`); ComfyUI's fp16 default would hold 10.4 GiB "
    "of weights beside 10.4 GiB of file. The VAE in ComfyUI's default (fp32 on the CPU), as VAELoader builds it "
    "(`VAE(sd=load_torch_file(path))`)."
)


def split_loaders(
    runs: int,
    paths: dict[str, Path],
    worker: Worker,
    aggregate: Callable,
    models: tuple[SplitModel, ...] = SPLIT_MODELS,
) -> tuple[list, str]:
    rows = [f"| model (loaded to CPU) {LOAD_HEADER}", LOAD_RULE]
    raw, verdicts, skipped = [], [], []
    for model in models:
        files = [str(paths[label]) for label in model.files]
        cold = [path.name for path in too_large_to_cache([paths[label] for label in model.files])]
        skipped += cold

        def measure(who: str, model: SplitModel = model, files: list[str] = files) -> dict:
            settle_page_cache([Path(file) for file in files], list(paths.values()))
            return worker("split", who, model.kind, model.dtype, *files)

        pairs = paired(runs, measure)
        resident = aggregate([pair["ours"]["resident"] for pair in pairs]).median
        stored = pairs[0]["ours"]["stored"]  # bytes per dtype: the floor converts to the dtype that holds most
        kept = max(stored, key=stored.get)
        settle_page_cache([Path(file) for file in files], list(paths.values()))  # the loads' state
        floor = worker(kept, str(int(resident)), "1" if cold else "0", *files, module="tools.bench.floor")
        raw.append({"model": model.label, "kind": model.kind, "dtype": model.dtype, "runs": pairs, "floor": floor})
        rows += load_rows(model.label, pairs, aggregate)
        rows.append(floor_row(model.label, floor, pairs, aggregate))
        verdicts.append(verdict(model.label, pairs, aggregate, floor))
    note = SPLIT_NOTE.format(skipped=", ".join(skipped) or "none")
    return raw, "\n".join([*rows, "", *verdicts, "", note, "", FLOOR_NOTE])


def floor_row(label: str, floor: dict, pairs: list[dict[str, dict]], aggregate: Callable) -> str:
    """The floor's row: its time (processor time over the cores) and its ratio to ComfyUI's median time."""
    comfyui = aggregate([pair["comfyui"]["seconds"] for pair in pairs]).median
    return (
        f"| {label} | floor: read + write + convert, processor time / {floor['cores']} cores | "
        f"{fmt_s(floor['floor'])} | {fmt_ratio(floor['floor'] / comfyui)} | - | - | - |"
    )


FLOOR_NOTE = (
    "The floor (`tools/bench/floor.py`, one run after the pairs): what any loader has to do, each part measured "
    "alone the fastest way we know, in processor time: read every byte of the files (positional reads of 128 KiB "
    "and of 16 MiB, the faster counted; a file the loads found uncached is dropped from the page cache first), "
    "write the resident bytes into fresh memory (on one thread and on torch's, the faster counted), and convert "
    "the files' dtype to the requested one in our float32 steps (timed on 256 Mi elements, scaled). These files "
    "are sparse or cached, so all three are processor work, and no load can take less wall time than their "
    "processor time over the cores. A time target below the floor's ratio cannot be met on this machine."
)


def verdict(label: str, pairs: list[dict[str, dict]], aggregate: Callable, floor: dict) -> str:
    """The targets, met or not by the medians (the time target beside the floor), and whether both loaders built
    the same weights in every run."""
    ours = aggregate([_load_figures(pair, "ours") for pair in pairs])
    comfyui = aggregate([pair["comfyui"]["seconds"] for pair in pairs]).median
    floor_ratio, ours_time = floor["floor"] / comfyui, aggregate([pair["ours"]["seconds"] for pair in pairs]).median
    same = all(pair["ours"]["stored"] == pair["comfyui"]["stored"] for pair in pairs)
    time_ok, peak_ok = ours["ratio"].median <= TIME_TARGET, ours["peak_ratio"].median <= PEAK_TARGET
    below = "below" if floor_ratio > TIME_TARGET else "above"
    return (
        f"- {label}: time {fmt_ratio(ours['ratio'].median)} of ComfyUI's (target <= {TIME_TARGET}x: "
        f"{'met' if time_ok else 'not met'}; the floor is {fmt_ratio(floor_ratio)}, so the target is {below} it "
        f"on this machine; ours is {ours_time / floor['floor']:.2f}x the floor); peak RSS "
        f"{ours['peak_ratio'].median:.2f}x resident (target <= "
        f"{PEAK_TARGET}x: {'met' if peak_ok else 'not met'}); the same weights (dtype and bytes) as ComfyUI's in "
        f"every run: {'yes' if same else 'no'}."
    )


def paired(runs: int, measure: Callable[[str], dict]) -> list[dict[str, dict]]:
    """``runs`` pairs of measurements, ComfyUI's and ours, each in a fresh process; who goes first alternates,
    so that neither always runs right after the other's load (page cache, memory the kernel reclaims)."""
    pairs = []
    for index in range(runs):
        order = [who for who, _name in LOADERS][:: 1 if index % 2 == 0 else -1]
        pair = {who: measure(who) for who in order}
        pairs.append({who: pair[who] for who, _name in LOADERS})
    return pairs


def load_rows(label: str, pairs: list[dict[str, dict]], aggregate: Callable) -> list[str]:
    """One table row per loader: time, ratio to ComfyUI's in the same run, peak RSS, resident, their ratio."""
    rows = []
    for who, name in LOADERS:
        spread = aggregate([_load_figures(pair, who) for pair in pairs])
        rows.append(
            f"| {label} | {name} | {spread['seconds'].show(fmt_s)} | {spread['ratio'].show(fmt_ratio)} "
            f"| {spread['extra'].show(fmt_gib)} | {spread['resident'].show(fmt_gib)} | "
            f"{spread['peak_ratio'].show(lambda v: f'{v:.2f}')} |"
        )
    return rows


def _load_figures(pair: dict[str, dict], who: str) -> dict[str, float]:
    r = pair[who]
    extra = r["peak"] - r["baseline"]
    return {
        "seconds": r["seconds"],
        "ratio": r["seconds"] / pair["comfyui"]["seconds"],
        "extra": extra,
        "resident": r["resident"],
        "peak_ratio": extra / r["resident"],
    }


def settle_page_cache(used: list[Path], others: list[Path]) -> None:
    """The same page cache before every run: the benchmark's other files dropped from it (so a load finds the
    memory they held free, not pages the kernel must reclaim first, which cost some runs seconds), a file too
    large to stay cached dropped too, and the rest of ``used`` read in."""
    cold = too_large_to_cache(used)
    for path in [*cold, *(path for path in others if path not in used)]:
        if path.exists():
            drop_from_page_cache(path)
    warm_page_cache(used)


def drop_from_page_cache(path: Path) -> None:
    """Ask the kernel to drop ``path``'s clean pages from the page cache (no privileges needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_page_cache(paths: list[Path]) -> list[Path]:
    """Read each file once, so that every loader finds it in the page cache; return the files left out.

    A file larger than half the memory available now is left out: it cannot stay cached beside the model
    loaded from it, and reading it would only push other files out.
    """
    skipped = too_large_to_cache(paths)
    for path in paths:
        if path in skipped:
            continue
        with open(path, "rb", buffering=0) as handle:
            chunk = bytearray(16 * 1024**2)
            while handle.readinto(chunk):
                pass
    return skipped


def too_large_to_cache(paths: list[Path]) -> list[Path]:
    """The files larger than half the memory available now (``warm_page_cache`` leaves them out)."""
    return [path for path in paths if path.stat().st_size > _available_bytes() // 2]


def _available_bytes() -> int:
    """``MemAvailable`` from ``/proc/meminfo`` (standard library only: this runs outside the runtime)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0
