"""Models another pack keeps quantised in a tensor class of its own (ComfyUI-GGUF's loaders), made placeable.

Their tensors cannot be moved by our transfers as they are (``core.weights.foreign``), and their layers and
patcher read them their own way. So Move To GPU and Split Model place a copy of the model's module tree instead:
every module a new object, every weight the same storage, the other pack's weights in our form and its layers our
cast layers. Nothing is copied in RAM and nothing is dequantised; the model then moves, streams and takes LoRA
patches as one our GGUF loaders built. The other pack's model and its other clones are left exactly as they were
(a clone elsewhere in the graph keeps computing with that pack's code); ComfyUI unloads them before each move, so
the copy starts from their weights in RAM, free of that pack's patches (a node that uses their model afterwards
loads it again, beside the copy). The copy is made once per model and kept with it: a second move of the same
model places the same copy, as for any model.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ...core.detection.ggml_types import ggml_type
from ...core.weights.foreign import foreign_quantized, is_foreign_quantized, own_foreign_quantized
from ...core.weights.ops import convert
from .books import clone_entries, unload_entries
from .filling import is_comfy_layer
from .subjects import Subject

#: ComfyUI's ModelPatcher tables that its clones share (what a load changed, to put back at unload).
BACKUP_TABLES = ("backup", "object_patches_backup", "backup_buffers", "pinned")
#: Where the copy of a model is kept, on the other pack's model (in its ``__dict__``: not a submodule of it).
OWNED_COPY = "device_control_owned_copy"


def placeable(subject: Subject) -> Subject:
    """``subject`` itself, or for a model another pack keeps quantised, a clone of it over our copy of the model
    (see the module's docstring), which Move To GPU and Split Model then place as any model.

    Raises:
        ModelFileError: a weight of a GGML type Device Control does not read (named), before anything changes.
    """
    model = subject.patcher.model
    if foreign_quantized(model) is None:
        return subject
    unload_entries(clone_entries(subject.patcher))  # first: its weights back in RAM, its patches taken off
    owned = model.__dict__.get(OWNED_COPY)
    if owned is None:
        owned = _owned_copy(model)
        model.__dict__[OWNED_COPY] = owned
    return _over(subject, owned)


def _owned_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The tree copy with the other pack's weights and layers made ours (see the module's docstring)."""
    owned = _tree_copy(model, {})
    changed = own_foreign_quantized(owned, lambda ggml_id, name: ggml_type(ggml_id, name))
    packs = {type(layer).__module__ for layer in changed}  # the other pack's layers, those holding plain weights too
    convert(owned, accept=lambda cls: is_comfy_layer(cls) or cls.__module__ in packs)
    return owned


def _tree_copy(module: torch.nn.Module, twins: dict[int, Any]) -> torch.nn.Module:
    """``module`` and its submodules as new objects holding the same weights: new parameter objects over the same
    storage (the other pack's own tensors are left for :func:`own_foreign_quantized` to replace), the same
    buffers' storage, and hook tables of their own, so nothing done to the copy reaches the original."""
    twin = copy.copy(module)
    for key, value in module.__dict__.items():
        if "device_control" in key:  # our own state about the original (an engine, books): not the copy's
            del twin.__dict__[key]
        elif isinstance(value, (dict, list)):  # _parameters, _buffers, _modules, hook tables, patch lists
            twin.__dict__[key] = type(value)(value)
    for table in (twin._parameters, twin._buffers, twin._modules):
        for name, value in table.items():
            if value is not None and not is_foreign_quantized(value):
                table[name] = _twin(value, twins)  # the other pack's own tensors are left to replace
    return twin


def _twin(value: Any, twins: dict[int, Any]) -> Any:
    """The copy's object for ``value`` (a parameter, buffer or module), one per original: what the original
    shares stays shared in the copy."""
    if id(value) not in twins:
        if isinstance(value, torch.nn.Module):
            twins[id(value)] = _tree_copy(value, twins)
        elif isinstance(value, torch.nn.Parameter):
            twins[id(value)] = torch.nn.Parameter(value.detach(), requires_grad=value.requires_grad)
        else:
            twins[id(value)] = value.detach()
    return twins[id(value)]


def _over(subject: Subject, owned: torch.nn.Module) -> Subject:
    """A clone of ``subject`` whose model is ``owned`` (its size measured again: our form is the same bytes, the
    other pack counts a scratch tensor besides)."""
    if subject.kind == "CLIP":
        value = subject.value.clone()
        value.cond_stage_model = owned
        patcher = value.patcher
    else:
        value = patcher = subject.patcher.clone()
    patcher.model = owned
    patcher.size = 0
    for table in BACKUP_TABLES:  # a clone shares its original's backups: they are of the other model's weights
        if isinstance(getattr(patcher, table, None), (dict, list, set)):
            setattr(patcher, table, type(getattr(patcher, table))())
    return Subject(subject.kind, value, patcher)
