"""Benchmark workers: each runs in a fresh runtime process and prints one JSON line of measurements.

    .runtime/venv/bin/python -m tools.bench.workers load comfyui|ours FILE
    .runtime/venv/bin/python -m tools.bench.workers split comfyui|ours KIND DTYPE FILE [FILE ...]
    .runtime/venv/bin/python -m tools.bench.workers detect comfyui|ours FILE [REPEATS]
    .runtime/venv/bin/python -m tools.bench.workers ops
    .runtime/venv/bin/python -m tools.bench.workers patch CHECKPOINT LORA
    .runtime/venv/bin/python -m tools.bench.workers policy CHECKPOINT

Run by ``tools/bench/run_all.py``; a fresh process per measurement, so one load's memory cannot flatter another's.
"""

from __future__ import annotations

import importlib
import json
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def _comfy(checkpoint_dir: Path) -> object:
    from tools.runtime.inprocess import import_comfy

    mm = import_comfy()
    import folder_paths

    folder_paths.add_model_folder_path("checkpoints", str(checkpoint_dir))
    return mm


def load(loader: str, path: Path) -> dict:
    """Load a checkpoint to the CPU with ComfyUI's loader or ours; time, memory and resident bytes."""
    mm = _comfy(path.parent)
    import comfy.sd  # in a running ComfyUI these are imported long before any load: keep imports out of the timing
    import comfy.supported_models

    if loader == "ours":
        node = _pack_module("nodes.load_checkpoint").LoadCheckpointWithDevice

        def run() -> list:
            model, clip, vae, _ = node.execute(path.name, "cpu", "cpu", "cpu", "auto", "auto", "auto").args
            return [model, clip.patcher, vae.patcher]
    else:

        def run() -> list:
            model, clip, vae, _ = comfy.sd.load_checkpoint_guess_config(str(path))
            return [model, clip.patcher, vae.patcher]

    return _measure(run, mm)


def _measure(run: Callable[[], list], mm: Any) -> dict:
    """Time ``run`` (a load that returns the patchers it made); memory around it and the bytes it left resident.

    ``peak`` is the process's highest RSS so far (the load's, since it started from a small baseline); it counts
    the pages of a memory-mapped file the load touched, as the operating system charges them to the process.
    """
    baseline = psutil.Process().memory_info().rss
    started = time.perf_counter()
    patchers = run()
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "baseline": baseline,
        "peak": _peak_rss(),
        "resident": sum(patcher.model_size() for patcher in patchers),
        "after": psutil.Process().memory_info().rss,
        "loaded_models": len(mm.current_loaded_models),
        "stored": _stored_bytes(patchers),
    }


def _stored_bytes(patchers: list) -> dict[str, int]:
    """Bytes of the loaded models' weights by dtype (both loaders must build the same thing)."""
    stored: dict[str, int] = {}
    for patcher in patchers:
        for tensor in [*patcher.model.parameters(), *patcher.model.buffers()]:
            key = str(tensor.dtype).replace("torch.", "")
            stored[key] = stored.get(key, 0) + tensor.numel() * tensor.element_size()
    return stored


def _pack_module(name: str) -> Any:
    from tools.runtime.inprocess import import_pack

    return importlib.import_module(f"{import_pack().__name__}.{name}")


#: ComfyUI's folder for each kind of split file.
SPLIT_FOLDERS = {"diffusion_model": "diffusion_models", "text_encoders": "text_encoders", "vae": "vae"}


def split_load(loader: str, kind: str, dtype: str, paths: list[Path]) -> dict:
    """Load a diffusion model, a set of text encoders or a VAE to the CPU, with ComfyUI's loader or ours.

    ``kind`` is ``diffusion_model``, ``vae`` or ``text_encoders:<type>`` (ComfyUI's CLIP type: ``sd3``...);
    ``dtype`` is one of our loaders' dtype names (``auto``: ComfyUI's default). ComfyUI's side is what its
    UNETLoader, CLIP loaders and VAELoader call: ``load_diffusion_model``, ``load_clip`` and ``VAE``.
    """
    kind, _, clip_type = kind.partition(":")
    mm = _comfy(paths[0].parent)
    import comfy.sd  # imported long before any load in a running ComfyUI: kept out of the timing
    import comfy.utils
    import folder_paths

    import nodes  # noqa: F401  ComfyUI's own nodes, imported at its start (our text-encoder types read them)

    for path in paths:
        folder_paths.add_model_folder_path(SPLIT_FOLDERS[kind], str(path.parent))
    if loader == "ours":
        run = _ours_split(kind, clip_type, dtype, [path.name for path in paths])
    else:
        run = _comfy_split(comfy, kind, clip_type, _pack_module("nodes.placing").DTYPES[dtype], paths)
    return _measure(run, mm)


def _ours_split(kind: str, clip_type: str, dtype: str, names: list[str]) -> Callable[[], list]:
    """Our node for ``kind``, called as ComfyUI calls it (its classes imported now, not in the timing)."""
    if kind == "diffusion_model":
        model_node = _pack_module("nodes.load_diffusion_model").LoadDiffusionModelWithDevice
        return lambda: [model_node.execute(names[0], "cpu", dtype).args[0]]
    if kind == "vae":
        vae_node = _pack_module("nodes.load_vae").LoadVAEWithDevice
        return lambda: [vae_node.execute(names[0], "cpu", dtype).args[0].patcher]
    clip_node = _pack_module("nodes.load_text_encoders").LoadTextEncodersWithDevice
    files = [*names, *["none"] * (4 - len(names))]
    return lambda: [clip_node.execute(*files, clip_type, "cpu", dtype).args[0].patcher]


def _comfy_split(comfy: Any, kind: str, clip_type: str, dtype: Any, paths: list[Path]) -> Callable[[], list]:
    """What ComfyUI's own loader node for ``kind`` calls (``dtype`` ``None``: its default)."""
    import folder_paths

    options = {} if dtype is None else {"dtype": dtype}
    if kind == "diffusion_model":
        return lambda: [comfy.sd.load_diffusion_model(str(paths[0]), model_options=options)]
    if kind == "vae":

        def vae() -> list:
            built = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(paths[0])), dtype=dtype)
            built.throw_exception_if_invalid()
            return [built.patcher]

        return vae
    files = [str(path) for path in paths]
    embeddings = folder_paths.get_folder_paths("embeddings")
    clip_kind = getattr(comfy.sd.CLIPType, clip_type.upper())
    return lambda: [comfy.sd.load_clip(files, embeddings, clip_kind, model_options=options).patcher]


def detect(detector: str, path: Path, repeats: int = 5) -> dict:
    """How long it takes to know what a file is: our header-only detection, or ComfyUI's (whole state dict)."""
    if detector == "ours":
        from core.detection.detect import detect as ours

        def run() -> str:
            return ours(path).comfy_class
    else:
        _comfy(path.parent)
        import comfy.model_detection
        import comfy.utils

        def run() -> str:
            sd = comfy.utils.load_torch_file(str(path))
            prefix = comfy.model_detection.unet_prefix_from_state_dict(sd)
            return type(comfy.model_detection.model_config_from_unet(sd, prefix)).__name__

    times = []
    found = None
    for _ in range(repeats):
        started = time.perf_counter()
        found = run()
        times.append(time.perf_counter() - started)
    return {
        "median": statistics.median(times),
        "min": min(times),
        "found": found,
        "size": path.stat().st_size,
        "peak": _peak_rss(),
    }


def cast_ops(repeats: int = 40) -> dict:
    """Forward time of cast layers: ours, ComfyUI's manual_cast, and plain torch in fp32 (no cast).

    The variants of a case run in turns, many times, and the best time of each counts: on a shared machine
    the minimum is the figure least disturbed by other work.
    """
    _comfy(Path("."))
    import comfy.ops
    import torch

    from core.weights import ops

    torch.manual_seed(0)
    cases = {  # SD1.5-sized: an attention projection at 32x32 latents, a 3x3 convolution of the first level
        "Linear 640x640, 2x1024 tokens": ("Linear", (640, 640), {}, torch.randn(2, 1024, 640)),
        "Conv2d 320->320 3x3, 32x32": ("Conv2d", (320, 320, 3), {"padding": 1}, torch.randn(1, 320, 32, 32)),
    }
    out = {}
    with torch.no_grad():
        for label, (name, args, kwargs, x) in cases.items():
            plain = getattr(torch.nn, name)(*args, **kwargs)
            variants = {"plain fp32": plain, "ours, no cast": ops.without_init(getattr(ops, name))(*args, **kwargs)}
            for storage in (torch.float16, torch.bfloat16):
                tag = str(storage).replace("torch.", "")
                variants[f"ComfyUI {tag}"] = getattr(comfy.ops.manual_cast, name)(*args, dtype=storage, **kwargs)
                variants[f"ours {tag}"] = ops.without_init(getattr(ops, name))(*args, dtype=storage, **kwargs)
                variants[f"ours {tag}"].comfy_cast_weights = True
            for layer in variants.values():
                layer.load_state_dict(plain.state_dict())
                layer(x)  # warm up
            best = dict.fromkeys(variants, float("inf"))
            for _ in range(repeats):
                for key, layer in variants.items():
                    started = time.perf_counter()
                    layer(x)
                    best[key] = min(best[key], time.perf_counter() - started)
            out[label] = {key: seconds * 1000 for key, seconds in best.items()}
    return out


def patching(checkpoint: Path, lora: Path, repeats: int = 9) -> dict:
    """Patch and restore a LoRA on the SD1.5 UNet: ComfyUI's ModelPatcher against ours, on the same module."""
    mm = _comfy(checkpoint.parent)
    import comfy.lora
    import comfy.model_patcher
    import comfy.utils
    import torch

    from tools.runtime.inprocess import import_pack

    pack = import_pack().__name__
    node = __import__(f"{pack}.nodes.load_checkpoint", fromlist=["x"])
    ours_class = __import__(f"{pack}.nodes.bridge.patcher", fromlist=["x"]).DeviceControlPatcher
    model = node.LoadCheckpointWithDevice.execute(checkpoint.name, "cpu", "cpu", "cpu", "fp16", "auto", "auto").args[0]
    key_map = comfy.lora.model_lora_keys_unet(model.model, {})
    patches = comfy.lora.load_lora(comfy.utils.load_torch_file(str(lora)), key_map, log_missing=False)
    mm.unload_all_models()
    cpu = torch.device("cpu")
    before = {k: v.clone() for k, v in model.model.state_dict().items()}
    patchers = {"ComfyUI 0.3.75": comfy.model_patcher.ModelPatcher, "Device Control": ours_class}
    patchers = {label: cls(model.model, cpu, cpu) for label, cls in patchers.items()}
    times: dict[str, list[float]] = {label: [] for label in patchers}
    exact = dict.fromkeys(patchers, True)
    for _ in range(repeats):  # alternate, so neither side always runs with warmer caches
        for label, patcher in patchers.items():
            if not patcher.patches:
                patcher.add_patches(patches, 1.0)
            started = time.perf_counter()
            patcher.patch_model()
            patcher.unpatch_model()
            times[label].append(time.perf_counter() - started)
            after = model.model.state_dict()
            exact[label] = exact[label] and all(torch.equal(after[k], v) for k, v in before.items())
    return {
        label: {
            "ms": statistics.median(times[label]) * 1000,
            "layers": len(patchers[label].patches),
            "exact": exact[label],
        }
        for label in patchers
    }


def policy(checkpoint: Path, repeats: int = 1) -> dict:
    """The SD1.5 UNet (fp16 storage, fp32 compute) under budgets on a simulated GPU, with each policy."""
    _comfy(checkpoint.parent)
    import torch

    from tools.runtime.inprocess import import_pack

    pack = import_pack().__name__
    node = __import__(f"{pack}.nodes.load_checkpoint", fromlist=["x"])
    loading = __import__(f"{pack}.core.placement.engine", fromlist=["x"])
    plans = __import__(f"{pack}.core.placement.plan", fromlist=["x"])
    simulated = __import__(f"{pack}.core.devices.sim.device", fromlist=["x"])
    model = node.LoadCheckpointWithDevice.execute(checkpoint.name, "cpu", "cpu", "cpu", "fp16", "auto", "auto").args[0]
    unet = model.model.diffusion_model
    device = simulated.SimulatedDevice(64 * 1024**3)
    engine = loading.partial_model_of(unet)
    total = engine.total_bytes()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 32, 32, generator=generator)
    context = torch.randn(2, 77, 768, generator=generator)
    steps = torch.tensor([500.0, 500.0])
    results = {}
    with torch.inference_mode():
        for share in (0.25, 0.5, 0.75):
            for chosen in plans.Policy:
                report = engine.load(device, int(total * share), policy=chosen)
                times = []
                for _ in range(repeats):
                    started = time.perf_counter()
                    unet(device.place(x), device.place(steps), device.place(context))
                    times.append(time.perf_counter() - started)
                results[f"{chosen.value}|{share}"] = {
                    "total": total,
                    "resident": report.resident_bytes,
                    "streamed_layers": report.plan.streamed_layers,
                    "reserve": report.plan.reserve_bytes,
                    "ms": min(times) * 1000,
                }
                engine.unload_all()
    return results


def main() -> None:
    kind = sys.argv[1]
    if kind == "ops":
        result = cast_ops()
    elif kind == "patch":
        result = patching(Path(sys.argv[2]), Path(sys.argv[3]))
    elif kind == "policy":
        result = policy(Path(sys.argv[2]))
    elif kind == "split":
        result = split_load(sys.argv[2], sys.argv[3], sys.argv[4], [Path(p) for p in sys.argv[5:]])
    else:
        who, path = sys.argv[2], Path(sys.argv[3])
        result = load(who, path) if kind == "load" else detect(who, path, int(sys.argv[4]) if len(sys.argv) > 4 else 5)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
