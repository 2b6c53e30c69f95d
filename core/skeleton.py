"""Build a module tree without memory for its weights, then allocate each weight once, where it will live.

:func:`parameters_on_meta` lets any constructor run (ComfyUI's included) while every parameter it registers
lands on torch's ``meta`` device: no memory, but shape and dtype kept. Buffers stay real, because many are
computed at construction (noise schedules, position ids) and are not in the file. :func:`materialize` then
gives every parameter real storage in its constructed dtype on the target device and fills it from a
:class:`~core.weights.WeightReader`, one tensor at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .weights import ProgressCallback, WeightReader

_patch_lock = threading.Lock()

#: Where a module's tensor comes from: a tensor name in the file, or a function computing it (for the few
#: tensors the host application transforms while loading, e.g. a transpose).
Source = str | Callable[[], torch.Tensor]


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within this context, every parameter registered on any module is created on the ``meta`` device.

    Only parameters move; buffers and plain tensors are untouched. The patch is process-wide while active (as
    in accelerate's ``init_empty_weights``), so it is held under a lock and always undone.
    """
    original = torch.nn.Module.register_parameter

    def register_parameter(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.data.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    with _patch_lock:
        torch.nn.Module.register_parameter = register_parameter
        try:
            yield
        finally:
            torch.nn.Module.register_parameter = original


@dataclass
class MaterializeResult:
    """What :func:`materialize` did: bytes placed, and names it had no source for."""

    loaded_bytes: int = 0
    missing: list[str] = field(default_factory=list)


def materialize(
    module: torch.nn.Module,
    sources: Mapping[str, Source],
    reader: WeightReader,
    device: torch.device | str = "cpu",
    *,
    progress: ProgressCallback | None = None,
) -> MaterializeResult:
    """Give every meta parameter of ``module`` real storage on ``device`` and fill it from its source.

    Each parameter keeps the dtype it was constructed with (that is the storage dtype the model asked for).
    A parameter that was built with a value (not on ``meta``) and has no source keeps that value. A meta
    parameter with no source is zero-filled and reported in ``missing`` (ComfyUI warns about the same keys
    and leaves them uninitialised). Buffers with a source are overwritten from it; the others keep their
    constructed values; everything ends on ``device``.

    Raises:
        ModelFileError: a source tensor is absent from the file or has the wrong number of elements.
        Exception: whatever ``progress`` raises (an interruption); tensors filled so far stay filled.
    """
    device = torch.device(device)
    result = MaterializeResult()
    tensors = [(name, tensor, True) for name, tensor in module.named_parameters(remove_duplicate=False)]
    tensors += [(name, tensor, False) for name, tensor in module.named_buffers(remove_duplicate=False)]
    total = sum(t.numel() * t.element_size() for _, t, _ in tensors)
    shared: dict[int, torch.nn.Parameter] = {}  # a parameter registered under two names stays one parameter
    for name, tensor, is_parameter in tensors:
        owner, attr = _owner(module, name)
        source = sources.get(name)
        if is_parameter and id(tensor) in shared:
            setattr(owner, attr, shared[id(tensor)])
            continue
        if is_parameter:
            if source is None and tensor.device.type != "meta":
                target = tensor.detach().to(device)
            else:
                target = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            if source is not None:
                _fill(target, source, reader)
            elif tensor.device.type == "meta":
                target.zero_()
                result.missing.append(name)
            shared[id(tensor)] = torch.nn.Parameter(target, requires_grad=tensor.requires_grad)
            setattr(owner, attr, shared[id(tensor)])
        else:
            target = tensor.to(device)
            if source is not None:
                _fill(target, source, reader)
            owner._buffers[attr] = target
        result.loaded_bytes += target.numel() * target.element_size()
        if progress is not None:
            progress(result.loaded_bytes, total)
    return result


def _fill(target: torch.Tensor, source: Source, reader: WeightReader) -> None:
    if isinstance(source, str):
        reader.read_into(source, target)
        return
    with torch.no_grad():
        target.copy_(source().reshape(target.shape))


def _owner(root: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (root.get_submodule(path) if path else root), attr
