"""Benchmark workers: each runs in a fresh runtime process and prints one JSON line of measurements.

    .runtime/venv/bin/python -m tools.bench_workers load comfyui|ours FILE
    .runtime/venv/bin/python -m tools.bench_workers detect comfyui|ours FILE [REPEATS]
    .runtime/venv/bin/python -m tools.bench_workers ops
    .runtime/venv/bin/python -m tools.bench_workers patch CHECKPOINT LORA
    .runtime/venv/bin/python -m tools.bench_workers policy CHECKPOINT

Run by ``tools/bench.py``; a fresh process per measurement, so one load's memory cannot flatter another's.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from pathlib import Path

import psutil


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def _comfy(checkpoint_dir: Path) -> object:
    from tools.comfy_inprocess import import_comfy

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
        from tools.comfy_inprocess import import_pack

        node = __import__(f"{import_pack().__name__}.nodes.load_checkpoint", fromlist=["x"])
    baseline = psutil.Process().memory_info().rss
    started = time.perf_counter()
    if loader == "ours":
        model, clip, vae, _ = node.LoadCheckpointWithDevice.execute(
            path.name, "cpu", "cpu", "cpu", "auto", "auto", "auto"
        ).args
    else:
        model, clip, vae, _ = comfy.sd.load_checkpoint_guess_config(str(path))
    seconds = time.perf_counter() - started
    resident = model.model_size() + clip.patcher.model_size() + vae.patcher.model_size()
    return {
        "seconds": seconds,
        "baseline": baseline,
        "peak": _peak_rss(),
        "resident": resident,
        "after": psutil.Process().memory_info().rss,
        "loaded_models": len(mm.current_loaded_models),
    }


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

    from tools.comfy_inprocess import import_pack

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

    from tools.comfy_inprocess import import_pack

    pack = import_pack().__name__
    node = __import__(f"{pack}.nodes.load_checkpoint", fromlist=["x"])
    loading = __import__(f"{pack}.core.placement.engine", fromlist=["x"])
    plans = __import__(f"{pack}.core.placement.plan", fromlist=["x"])
    simulated = __import__(f"{pack}.core.devices.simulated", fromlist=["x"])
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
    else:
        who, path = sys.argv[2], Path(sys.argv[3])
        result = load(who, path) if kind == "load" else detect(who, path, int(sys.argv[4]) if len(sys.argv) > 4 else 5)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
