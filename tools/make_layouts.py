"""Make ``tests/data/model_layouts_comfyui_<version>.json.gz``: the layouts of the families ComfyUI 0.28.0 and
0.33.0 added (``tools.layout_specs.ADDED``), one file per version, made with that ComfyUI.

No model hub is reachable from CI and real weights must never be committed, so, as for
``model_layouts.json.gz``, each family's layout (tensor names, shapes, dtypes; no values) comes from that
ComfyUI's own model class built on torch's ``meta`` device with the hyper-parameters of the released model. Its
diffusion-model ``state_dict`` is what ComfyUI reads from a ``diffusion_models/`` file; each layout is fed back
through ComfyUI's own detection, which must name the class it was built from, or the family is left out. Where a
constructor reads a value back from a tensor it made (``Tensor.item()``, which meta tensors cannot answer), only
those few small tensors are made on CPU, where their names, shapes and dtypes are the same (see ``Spec.context``).

Run with the runtime's Python and the ComfyUI whose families to lay out::

    DEVICE_CONTROL_COMFYUI=0.28.0 .runtime/venv/bin/python -m tools.make_layouts
    DEVICE_CONTROL_COMFYUI=0.33.0 .runtime/venv/bin/python -m tools.make_layouts
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import math
from pathlib import Path
from typing import Any

from tools.layout_specs import ADDED, INFERENCE_DTYPES, Spec
from tools.layouts import NEW_LAYOUTS

log = logging.getLogger("device_control.tools")


def _dtype_name(dtype: Any) -> str:
    """The safetensors name of a torch dtype (``BF16``, ``F32``, ...)."""
    from core.detection.headers import SAFETENSORS_DTYPES

    return next(name for name, (_size, torch_dtype) in SAFETENSORS_DTYPES.items() if torch_dtype == dtype)


def build(spec: Spec) -> tuple[dict[str, Any], str]:
    """ComfyUI's model for ``spec`` on meta: its diffusion-model state dict (file names), and its model type.

    Raises:
        ValueError: ComfyUI's own loader would not turn the file names of ``spec.to_file`` back into its model's.
    """
    import comfy.supported_models
    import torch

    cls = getattr(comfy.supported_models, spec.comfy_class)
    with spec.context():
        config = cls({**cls.unet_config, **spec.config})
        config.set_inference_dtype(getattr(torch, INFERENCE_DTYPES[spec.dtype]), None)
        rest = spec.checkpoint_rest(config.unet_config) if spec.checkpoint_rest is not None else {}
        model = config.get_model(rest, "", device=torch.device("meta"))
    state = dict(model.diffusion_model.state_dict())
    if spec.to_file is not None:
        internal, state = state, spec.to_file(state)
        loaded = config.process_unet_state_dict(dict(state))
        if _signature(loaded) != _signature(internal):
            raise ValueError("ComfyUI's loader does not turn the file's names back into its model's")
    return state, model.model_type.name


def _signature(state: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Names, shapes and dtypes: all a layout holds of a state dict."""
    return {name: (tuple(t.shape), t.dtype) for name, t in state.items()}


def detected_class(state: dict[str, Any]) -> str | None:
    """What ComfyUI's ``load_diffusion_model`` path detects ``state`` as (meta tensors, no prefix)."""
    import comfy.model_detection

    prefix = comfy.model_detection.unet_prefix_from_state_dict(state)
    stripped = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)} or state
    config = comfy.model_detection.model_config_from_unet(stripped, "")
    return type(config).__name__ if config is not None else None


def layout(spec: Spec, state: dict[str, Any], model_type: str, version: str) -> dict[str, Any]:
    """The layout record, in the format of ``model_layouts.json.gz`` (see ``tests/data/README.md``)."""
    tensors = {name: [list(t.shape), _dtype_name(t.dtype)] for name, t in sorted(state.items())}
    exceptions = {name: dtype for name, (_shape, dtype) in tensors.items() if dtype != spec.dtype}
    return {
        "family": spec.family,
        "comfy_detected": spec.comfy_class,
        "kind": "diffusion_model",
        "dtype_default": spec.dtype,
        "param_count": sum(math.prod(shape) for shape, _dtype in tensors.values()),
        "tensor_count": len(tensors),
        "comfy_detection": {
            "unet_prefix": "model.",
            "path": "load_diffusion_model_state_dict",
            "class": spec.comfy_class,
            "model_type": model_type,
        },
        "comfy_native_dtype_exceptions": exceptions,
        "source": (
            f"ComfyUI {version} model class instantiated on meta with inference dtype"
            f" {INFERENCE_DTYPES[spec.dtype]}; state_dict()"
            f" of diffusion_model (no prefix); hyper-parameters: {spec.source}"
        ),
        "tensors": tensors,
    }


def make_all(version: str, only: set[str] | None = None) -> dict[str, dict[str, Any]]:
    """Every layout of the families ComfyUI ``version`` (the one imported) added that its own detection confirms,
    by file name; the others are logged and left out."""
    specs, not_built = ADDED[version]
    for name, why in not_built.items():
        log.warning("[Device Control] %s: no layout, %s", name, why)
    made: dict[str, dict[str, Any]] = {}
    for spec in specs:
        if only and spec.comfy_class not in only:
            continue
        try:
            state, model_type = build(spec)
        except Exception as error:  # a class that cannot be built on meta is skipped, and said so
            log.warning("[Device Control] %s: no layout, cannot be built (%s)", spec.comfy_class, error)
            continue
        found = detected_class(state)
        if found != spec.comfy_class:
            log.warning("[Device Control] %s: no layout, ComfyUI detects the layout as %s", spec.comfy_class, found)
            continue
        made[f"{spec.stem}.diffusion_model.json"] = layout(spec, state, model_type, version)
        log.info("[Device Control] %s (%s): %d tensors", spec.comfy_class, spec.stem, len(state))
    return made


def write(layouts: dict[str, dict[str, Any]], path: Path) -> Path:
    """Write ``layouts`` gzipped (no name, mtime 0: the same layouts give the same bytes)."""
    raw = json.dumps(layouts, separators=(",", ":"), sort_keys=True).encode()
    with open(path, "wb") as handle, gzip.GzipFile(filename="", fileobj=handle, mode="wb", mtime=0) as packed:
        packed.write(raw)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Write the layouts of the model families the selected ComfyUI"
        f" ({' or '.join(ADDED)}, by DEVICE_CONTROL_COMFYUI) added, built on meta."
    )
    parser.add_argument("--only", nargs="*", help="comfy.supported_models class names (default: every family)")
    parser.add_argument("--output", type=Path, help="where to write the gzipped JSON (default: its tests/data file)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # ComfyUI's own INFO lines are noise here
    log.setLevel(logging.INFO)
    from tools.comfy_inprocess import import_comfy
    from tools.runtime import DEFAULT_VERSION

    if DEFAULT_VERSION not in ADDED:
        wanted = " or ".join(ADDED)
        log.error("[Device Control] run with DEVICE_CONTROL_COMFYUI=%s (got %s)", wanted, DEFAULT_VERSION)
        return 2
    import_comfy()
    made = make_all(DEFAULT_VERSION, set(args.only) if args.only else None)
    path = write(made, args.output or NEW_LAYOUTS[DEFAULT_VERSION])
    log.info("[Device Control] wrote %d layouts to %s", len(made), path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
