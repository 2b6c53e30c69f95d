"""ComfyUI's standard layers compute with the pack's cast layers while Device Control places their model.

A model ComfyUI's own loaders built has ComfyUI's layers, which stream with ComfyUI's cast code, a tensor at a
time. So that such a model streams through the pack's ring (groups of layers, one copy each) and its large layers in
row slices, the patcher turns ComfyUI's standard Linear, 1-d/2-d convolution, group and layer norm layers
(``surface.standard_layer_classes``) into the pack's cast layers
when it loads the model (``core.weights.ops.convert``: each layer's class changes, its weights and attributes do
not), and turns them back when ComfyUI unloads it. The pack's layers compute what ComfyUI's compute, bit for bit
(``integration/test_ops_oracle.py``), and speak ComfyUI's layer protocol, so a branch of the graph that uses the
same model the stock way meanwhile computes the same. Left alone, streaming whole as before: layers of ComfyUI's
other ops families (fp8 matmuls, quantized and scaled layers), other packs' layers, 3-d convolutions (ComfyUI
0.2x gives them an ``autopad`` argument of their own), and every layer of a model ComfyUI's Dynamic VRAM
manages (its layers read their weights through their own mapping).
"""

from __future__ import annotations

from typing import Any

import torch

from ...core.weights.ops import ConvertedTree, convert
from .. import surface

_CONVERTED = "_device_control_converted"


def take_layers(model: torch.nn.Module, engine: Any) -> None:
    """Turn ``model``'s standard ComfyUI layers into cast layers (once, until :func:`give_back_layers`)."""
    if _CONVERTED in model.__dict__ or any("_v" in module.__dict__ for module in model.modules()):
        return
    standard = surface.standard_layer_classes()
    handle = convert(model, accept=lambda cls: cls in standard)
    model.__dict__[_CONVERTED] = handle
    if handle.layers:
        engine.refresh()


def give_back_layers(model: torch.nn.Module, engine: Any) -> None:
    """Give ``model``'s converted layers their ComfyUI classes back (ComfyUI unloaded the model)."""
    handle: ConvertedTree | None = model.__dict__.pop(_CONVERTED, None)
    if handle is not None and handle.layers:
        handle.undo()
        engine.refresh()
