"""Weights another pack keeps in a tensor class of its own, and how they become this pack's own form.

ComfyUI-GGUF (the common way to run GGUF files in ComfyUI) keeps each weight as a ``torch.Tensor`` subclass whose
raw bytes are the file's (GGML blocks, or plain F32/F16 values) and whose ``tensor_type`` and ``tensor_shape``
attributes say how to read them; its layers dequantise from those attributes. A copy of such a tensor to another
device that does not go through the subclass's own ``to`` (our transfers copy into buffers of their own, and a
simulated device wraps its tensors) keeps the bytes and loses the attributes, and the layer then multiplies raw
blocks: a shape error at best. So such a model is recognised by the attributes alone (the pack is never imported),
and :func:`own_foreign_quantized` turns its weights into the form this pack's own GGUF loaders give them: plain
``uint8`` parameters of the same bytes, their layers told how to read them (``core.weights.quantized``), or plain
float parameters; the same storage either way, nothing copied or dequantised. Every path here knows that form.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .ggml_blocks import BlockLayout
from .quantized import layout_of, quantize_parameter, set_quantized

#: The attributes that mark a tensor as quantised by another pack (ComfyUI-GGUF's ``GGMLTensor``).
FOREIGN_MARKS = ("tensor_type", "tensor_shape")


def is_foreign_quantized(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is held in another pack's quantised tensor class (it carries :data:`FOREIGN_MARKS`)."""
    return all(hasattr(tensor, mark) for mark in FOREIGN_MARKS)


def foreign_quantized(model: torch.nn.Module) -> str | None:
    """The name of the first parameter of ``model`` held in another pack's quantised tensor class, else ``None``."""
    for name, parameter in model.named_parameters():
        if is_foreign_quantized(parameter):  # the subclass itself is the parameter
            return name
    return None


#: GGML's numbers of the types another pack keeps as plain float tensors (F32, F16): no blocks to read.
PLAIN_TYPES = frozenset({0, 1})


def own_foreign_quantized(model: torch.nn.Module, kind_of: Callable[[int, str], BlockLayout]) -> set[torch.nn.Module]:
    """Turn, in place, every parameter of ``model`` held in another pack's quantised class into this pack's form
    (see the module's docstring); return the layers changed, which must compute through cast layers from now on.
    A parameter two layers share stays shared.

    Args:
        model: a tree this pack owns (a copy: the other pack's layers still read the tensors it was given).
        kind_of: the block layout of a GGML type number, for the tensor named (raising for a type not read).

    Raises:
        ModelFileError: a type not read, or bytes that are not the size of the weight's shape (before that
            layer changes).
    """
    changed: set[torch.nn.Module] = set()
    done: dict[int, tuple[torch.nn.Parameter, torch.nn.Module, str]] = {}
    for path, layer in model.named_modules():
        for name, parameter in list(layer._parameters.items()):
            if parameter is None or not is_foreign_quantized(parameter):
                continue
            if id(parameter) in done:  # tied: the same parameter, read the same way
                owned, owner, owner_name = done[id(parameter)]
                _share(layer, name, owned, owner, owner_name)
            else:
                _own(layer, name, parameter, kind_of, f"{path}.{name}" if path else name)
                done[id(parameter)] = (layer._parameters[name], layer, name)
            changed.add(layer)
    return changed


def _own(
    layer: torch.nn.Module,
    name: str,
    parameter: torch.Tensor,
    kind_of: Callable[[int, str], BlockLayout],
    qualified: str,
) -> None:
    shape = tuple(int(dim) for dim in parameter.tensor_shape)
    raw = parameter.as_subclass(torch.Tensor).detach()  # the same bytes, as a plain tensor
    ggml_id = int(parameter.tensor_type) if parameter.tensor_type is not None else 0
    if ggml_id in PLAIN_TYPES:
        layer._parameters[name] = torch.nn.Parameter(raw.reshape(shape), requires_grad=False)
    else:
        quantize_parameter(layer, name, raw, kind_of(ggml_id, qualified), shape)


def _share(
    layer: torch.nn.Module, name: str, owned: torch.nn.Parameter, owner: torch.nn.Module, owner_name: str
) -> None:
    layout = layout_of(owner, owner_name)
    if layout is None:
        layer._parameters[name] = owned
    else:
        set_quantized(layer, name, owned, layout)
