"""Build a module tree without memory for its weights, then allocate each weight once, where it will live.

:func:`weights_on_meta` lets any constructor run (ComfyUI's included) while every large uninitialised tensor
it asks for (``torch.empty``: how layers allocate weights they will load) is created on torch's ``meta``
device: no memory, but shape and dtype kept. Small tensors stay real, and so do tensors created with a value
(``ones``, ``zeros``, ``arange``... noise schedules, position ids, a per-layer fp8 scale of 1), even when the
constructor asked for them on ``meta``: their values are not in the file. :func:`materialize` then gives every
meta tensor real storage in its constructed dtype, where an allocator says (host memory, or a device through its
backend's ``empty``), and fills it from a :class:`~core.weights.WeightReader`, one tensor at a time.

The mode is a torch function mode: it only affects the thread that entered it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from math import prod

import torch
from torch.overrides import TorchFunctionMode

from ..detection.ggml_types import GGML_TYPES
from ..detection.tensor_info import SAFETENSORS_DTYPES
from ..errors import ModelFileError
from ..progress import ProgressCallback
from ..weights.ggml_blocks import dequantize
from ..weights.quantized import QuantizedLayout, quantized_parameter, set_quantized
from .reader import WeightReader

#: Where a module's tensor comes from: a tensor name in the file, or a function computing it (for the few
#: tensors the host application transforms while loading, e.g. a transpose).
Source = str | Callable[[], torch.Tensor]

#: Gives uninitialised storage of a shape and dtype where a model's weights are to live.
Allocate = Callable[[torch.Size, torch.dtype], torch.Tensor]

#: Tensors up to this many elements are always real: scales, scalars, tiny buffers.
SMALL = 64
_META = torch.device("meta")
_VALUED_FACTORIES = frozenset(
    {
        torch.ones,
        torch.zeros,
        torch.full,
        torch.eye,
        torch.arange,
        torch.linspace,
        torch.tensor,
        torch.ones_like,
        torch.zeros_like,
        torch.full_like,
    }
)


def _numel(args: tuple, kwargs: dict) -> int:
    size = kwargs.get("size", args[0] if args else ())
    if isinstance(size, int):
        return prod((size, *args[1:])) if all(isinstance(a, int) for a in args[1:]) else size
    return prod(size) if isinstance(size, (tuple, list, torch.Size)) else SMALL + 1


class _WeightsOnMeta(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.empty and _numel(args, kwargs) > SMALL:
            kwargs["device"] = _META  # a weight the file will fill: no memory now
        elif func in _VALUED_FACTORIES and torch.device(kwargs.get("device") or "cpu") == _META:
            kwargs["device"] = "cpu"  # a value the constructor means (1.0, a schedule): keep it real
        return func(*args, **kwargs)


@contextmanager
def weights_on_meta() -> Iterator[None]:
    """Within this context (this thread only), large ``torch.empty`` tensors are created on ``meta``."""
    with _WeightsOnMeta():
        yield


@dataclass
class MaterializeResult:
    """What :func:`materialize` did: bytes placed, and names it had no source for."""

    loaded_bytes: int = 0
    missing: list[str] = field(default_factory=list)


def host_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The default :data:`Allocate`: host memory, in the process's default pages. (Asking Linux for 2 MiB pages
    here cost more than it saved: where free memory is fragmented, as after the page cache gave some back, each
    huge page waited for compaction, and a 0.31 GiB VAE loaded in 0.75 s instead of 0.25 s.)"""
    return torch.empty(shape, dtype=dtype)


def materialize(
    module: torch.nn.Module,
    sources: Mapping[str, Source],
    reader: WeightReader,
    allocate: Allocate = host_empty,
    *,
    progress: ProgressCallback | None = None,
    keeps_blocks: Callable[[torch.nn.Module], bool] = lambda _owner: False,
) -> MaterializeResult:
    """Give every tensor of ``module`` storage from ``allocate`` and fill it from its source.

    Each tensor keeps the dtype it was constructed with (the storage dtype the model asked for). A tensor
    built with a value and without a source keeps that value. A meta parameter without a source is
    zero-filled and reported in ``missing`` (ComfyUI warns about the same keys and leaves them uninitialised);
    a meta buffer without a source cannot be guessed and is an error. A tensor known under several names
    (tied weights) stays one tensor, filled from the last name that has a source, as ``load_state_dict`` does.
    Everything ends where ``allocate`` put it. A quantised source (a GGUF's GGML blocks) keeps its blocks where
    ``keeps_blocks`` says its owner layer dequantises them in its cast (``core.weights.quantized``); anywhere
    else it is dequantised once, into the dtype the model asked for.

    Raises:
        ModelFileError: a source tensor is absent or misshapen, or a buffer has no source.
        Exception: whatever ``progress`` raises (an interruption); tensors filled so far stay filled.
    """
    result = MaterializeResult()
    names, tensors = _tensors_by_identity(module)
    total = sum(t.numel() * t.element_size() for t, _ in tensors.values())
    for key, (tensor, is_parameter) in tensors.items():
        aliases = names[key]
        source = next((sources[n] for n in reversed(aliases) if n in sources), None)
        if is_parameter and _keeps_blocks(module, aliases, source, reader, keeps_blocks):
            result.loaded_bytes += _fill_quantized(module, aliases, tensor, source, reader, allocate)
        else:
            result.loaded_bytes += _fill_plain(
                module, aliases, (tensor, is_parameter), source, reader, allocate, result
            )
        if progress is not None:
            progress(result.loaded_bytes, total)
    return result


def _keeps_blocks(
    module: torch.nn.Module,
    aliases: list[str],
    source: Source | None,
    reader: WeightReader,
    keeps_blocks: Callable[[torch.nn.Module], bool],
) -> bool:
    """Whether ``source`` is quantised and every layer that holds it dequantises in its cast."""
    return _quantized(source, reader) and all(keeps_blocks(_owner(module, name)[0]) for name in aliases)


def _fill_plain(
    module: torch.nn.Module,
    aliases: list[str],
    tensor_kind: tuple[torch.Tensor, bool],
    source: Source | None,
    reader: WeightReader,
    allocate: Allocate,
    result: MaterializeResult,
) -> int:
    """Give one tensor (``(tensor, is_parameter)``) storage in its dtype, fill it, put it under every alias;
    return its bytes."""
    tensor, is_parameter = tensor_kind
    target = _allocate(tensor, source, allocate, aliases[0], is_parameter, result)
    if source is not None:
        _fill(target, source, reader)
    value = torch.nn.Parameter(target, requires_grad=tensor.requires_grad) if is_parameter else target
    for name in aliases:
        owner, attr = _owner(module, name)
        (owner._parameters if is_parameter else owner._buffers)[attr] = value
    return target.numel() * target.element_size()


def _tensors_by_identity(
    module: torch.nn.Module,
) -> tuple[dict[int, list[str]], dict[int, tuple[torch.Tensor, bool]]]:
    """Each tensor of ``module`` once (tied ones under all their names), and whether it is a parameter."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, tuple[torch.Tensor, bool]] = {}
    for is_parameter, named in ((True, module.named_parameters), (False, module.named_buffers)):
        for name, tensor in named(remove_duplicate=False):
            if tensor is not None:
                names.setdefault(id(tensor), []).append(name)
                tensors[id(tensor)] = (tensor, is_parameter)
    return names, tensors


def _allocate(
    tensor: torch.Tensor,
    source: Source | None,
    allocate: Allocate,
    name: str,
    is_parameter: bool,
    result: MaterializeResult,
) -> torch.Tensor:
    if source is not None:
        return allocate(tensor.shape, tensor.dtype)
    if tensor.device.type != "meta":  # a value the constructor computed: kept, where the rest goes
        with torch.no_grad():
            return allocate(tensor.shape, tensor.dtype).copy_(tensor)
    if not is_parameter:
        raise ModelFileError(
            f"the model's buffer {name!r} is not in the file and cannot be computed; the file does "
            "not match the model ComfyUI builds for it."
        )
    result.missing.append(name)
    with torch.no_grad():
        return allocate(tensor.shape, tensor.dtype).zero_()


def _quantized(source: Source | None, reader: WeightReader) -> bool:
    return isinstance(source, str) and reader.info(source).dtype not in SAFETENSORS_DTYPES


def _fill_quantized(
    module: torch.nn.Module,
    aliases: list[str],
    tensor: torch.Tensor,
    source: str,
    reader: WeightReader,
    allocate: Allocate,
) -> int:
    """Put the quantised blocks of ``source`` where ``allocate`` says, as every alias's parameter (one tensor),
    each owner told how to read them (``core.weights.quantized``); return the bytes placed.

    Raises:
        ModelFileError: the file's tensor has another number of values than the parameter.
    """
    info = reader.info(source)
    shape = tuple(tensor.shape)
    if info.numel != tensor.numel():
        raise ModelFileError(
            f"{reader.file_name(source)}: tensor {source!r} has shape {list(info.shape)}, but the model "
            f"expects {list(shape)}; the file belongs to another model variant."
        )
    layout = QuantizedLayout(GGML_TYPES[info.dtype], shape)
    blocks = allocate(torch.Size(layout.row_shape()), torch.uint8)
    reader.read_blocks_into(source, blocks)
    parameter = quantized_parameter(blocks, layout)
    for name in aliases:
        owner, attr = _owner(module, name)
        set_quantized(owner, attr, parameter, layout)
    return blocks.numel()


def _fill(target: torch.Tensor, source: Source, reader: WeightReader) -> None:
    if _quantized(source, reader):  # quantised, in a place that cannot dequantise: dequantised once, here
        info = reader.info(source)
        blocks = torch.empty(info.nbytes, dtype=torch.uint8)
        reader.read_blocks_into(source, blocks)
        with torch.no_grad():
            target.copy_(dequantize(blocks, GGML_TYPES[info.dtype], target.shape))
        return
    if isinstance(source, str):
        reader.read_into(source, target)
        return
    with torch.no_grad():
        target.copy_(source().reshape(target.shape))


def _owner(root: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (root.get_submodule(path) if path else root), attr
