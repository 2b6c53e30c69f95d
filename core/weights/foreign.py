"""Weights another pack keeps in a tensor class of its own, which Device Control cannot move or patch.

ComfyUI-GGUF (the common way to run GGUF files in ComfyUI) keeps each quantised weight as a ``torch.Tensor``
subclass whose raw bytes are the GGML blocks and whose ``tensor_type`` and ``tensor_shape`` attributes say how
to read them; its layers dequantise from those attributes. A copy of such a tensor to another device that does
not go through the subclass's own ``to`` (our transfers copy into buffers of their own, and a simulated device
wraps its tensors) keeps the bytes and loses the attributes, and the layer then multiplies raw blocks: a shape
error at best. So a model holding such tensors is recognised by the attributes alone (the pack is never
imported) and refused with the way forward, before anything moves; this pack's own GGUF loaders keep the blocks
as plain ``uint8`` parameters that every path here knows (``core.weights.quantized``).
"""

from __future__ import annotations

import torch

#: The attributes that mark a tensor as quantised by another pack (ComfyUI-GGUF's ``GGMLTensor``).
FOREIGN_MARKS = ("tensor_type", "tensor_shape")


def foreign_quantized(model: torch.nn.Module) -> str | None:
    """The name of the first parameter of ``model`` held in another pack's quantised tensor class, else ``None``."""
    for name, parameter in model.named_parameters():
        if all(hasattr(parameter, mark) for mark in FOREIGN_MARKS):  # the subclass itself is the parameter
            return name
    return None
