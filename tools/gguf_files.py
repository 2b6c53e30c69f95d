"""GGUF copies of our synthetic diffusion models, quantised by the GGML project's own ``gguf`` package (the test
oracle, never a dependency of the pack): what the GGUF tests, the example workflow and the benchmark load.

A weight is quantised the way GGUF converters do it: a layer's weight matrix (two or more dimensions) whose rows are
whole blocks and that is not tiny takes the type asked for; vectors, small tensors and other tensors (a positional
table) stay F32. A tensor of more than four
dimensions (a video model's patch embedding) is stored flattened to two, with its shape recorded under
``comfy.gguf.orig_shape.<name>``, as ComfyUI's GGUF converters record it.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open

#: The Flux-layout example's GGUF: the synthetic Flux.1 dev model quantised to Q8_0 (``make_all()`` key ``flux_gguf``).
FLUX_GGUF = "device_control_flux_dev_d1_Q8_0.gguf"
#: Tensors smaller than this stay F32 (converters keep small ones unquantised: they cost nothing).
SMALL = 1024
ORIG_SHAPE = "comfy.gguf.orig_shape."


def quantised_type(name: str, shape: tuple[int, ...], kind: str) -> gguf.GGMLQuantizationType:
    """The type a converter gives tensor ``name`` of ``shape`` when asked for ``kind`` (``Q8_0``, ``Q4_0``, ...)."""
    quant = gguf.GGMLQuantizationType[kind]
    values = gguf.GGML_QUANT_SIZES[quant][0]
    if not name.endswith(".weight") or len(shape) < 2 or int(np.prod(shape)) < SMALL or shape[-1] % values:
        return gguf.GGMLQuantizationType.F32
    return quant


def write_gguf(source: Path, target: Path, kind: str, architecture: str) -> Path:
    """``source`` (a safetensors diffusion model) as a GGUF file quantised to ``kind``; made once, then reused."""
    if target.exists() and target.stat().st_mtime >= source.stat().st_mtime:
        return target
    partial = target.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), architecture)
    with safe_open(str(source), framework="pt") as tensors:
        for name in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
            _add(writer, name, tensors.get_tensor(name), kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(target)
    return target


def _add(writer: gguf.GGUFWriter, name: str, tensor: torch.Tensor, kind: str) -> None:
    values = tensor.float().numpy()
    if values.ndim > 4:  # GGUF holds four dimensions at most
        writer.add_array(ORIG_SHAPE + name, list(values.shape))
        values = values.reshape(values.shape[0], -1)
    quant = quantised_type(name, values.shape, kind)
    if quant == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
        return
    writer.add_tensor(name, gguf.quants.quantize(values, quant), raw_dtype=quant)


def dequantised_twin(source: Path, target: Path) -> Path:
    """The GGUF ``source`` as a float32 safetensors file, every tensor as ``gguf`` dequantises it (the oracle's
    model: what the quantised model must compute)."""
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(str(source))
    shapes = {
        field.name.removeprefix(ORIG_SHAPE): [int(v) for v in field.contents()]
        for field in reader.fields.values()
        if field.name.startswith(ORIG_SHAPE)
    }
    out = {}
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        shape = shapes.get(tensor.name, [int(d) for d in reversed(tensor.shape)])
        out[tensor.name] = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)
    save_file(out, str(target))
    return target
