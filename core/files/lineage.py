"""Learn, without reading any weight, where each tensor of a model comes from in its file.

Host applications rename keys and sometimes transform values while loading (split a fused projection into
three, transpose a matrix). To stream weights straight into their final tensors we must know, for every
tensor of the model, which file tensor it comes from and what is done to it on the way. We find out by
letting the host's own loading code run on stand-ins:

* :func:`source_tensors` makes a ``meta`` tensor per file tensor (shape and dtype, no data), tagged with
  its name;
* :class:`Tracer` records, on every tensor computed from tagged ones, the operation that produced it;
* :func:`capture_state_dict_loads` intercepts ``Module.load_state_dict`` for the duration (and only then),
  recording what each module would have been given instead of copying it.

:func:`source_of` then turns what a module would have received into a
:data:`~core.skeleton.Source`: a file tensor name, or a function that replays the recorded operations on
the real tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from ..detection.headers import SAFETENSORS_DTYPES, TensorInfo
from .skeleton import Source

_TAG = "_device_control_lineage"
_lock = threading.Lock()


def source_tensors(
    tensors: Mapping[str, TensorInfo],
    probes: Mapping[str, torch.Tensor] | None = None,
    qualify: Callable[[str], str] = str,
) -> dict:
    """A stand-in state dict: one tagged ``meta`` tensor per file tensor.

    Args:
        tensors: the file's header entries.
        probes: real values for the few tensors a host reads by value while building a model (for example
            the one SD2 uses to tell eps from v-prediction); they are tagged like the others.
        qualify: the name a tensor's tag carries, from its name in the file (for a file of a
            :class:`~core.files.fileset.FileSet`, its qualified name); the state dict keeps the file's names.
    """
    out: dict[str, torch.Tensor] = {}
    for name, info in tensors.items():
        # A quantised GGUF tensor stands in as bytes of its logical shape: ComfyUI reads shapes, and a dtype it
        # does not compute in lets it choose the model's dtype for the device, as for any unknown weight dtype.
        dtype = SAFETENSORS_DTYPES.get(info.dtype, (0, None))[1] or torch.uint8
        tensor = probes[name] if probes and name in probes else torch.empty(info.shape, dtype=dtype, device="meta")
        setattr(tensor, _TAG, ("file", qualify(name)))
        out[name] = tensor
    return out


class Tracer(TorchFunctionMode):
    """Records, on each result computed from tagged tensors, how it was computed."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if not _has_lineage((args, kwargs)):
            return result
        recipe = ("op", func, args, kwargs)
        if isinstance(result, torch.Tensor) and not hasattr(result, _TAG):
            setattr(result, _TAG, recipe)
        elif isinstance(result, (tuple, list)):
            for index, item in enumerate(result):
                if isinstance(item, torch.Tensor) and not hasattr(item, _TAG):
                    setattr(item, _TAG, ("item", recipe, index))
        return result


def _has_lineage(item: Any) -> bool:
    # Called on every operation while tracing: a plain walk is several times faster than a pytree map.
    if isinstance(item, torch.Tensor):
        return hasattr(item, _TAG)
    if isinstance(item, (list, tuple)):
        return any(_has_lineage(x) for x in item)
    if isinstance(item, dict):
        return any(_has_lineage(x) for x in item.values())
    return False


_capturing = threading.local()
_active = 0  # contexts open in any thread (under _lock)
_saved: Callable[..., Any] | None = None  # the method in place when the first context opened
_beneath = False  # another library wrapped ours: it stays installed, beneath that wrapper


def _load_state_dict(
    module: torch.nn.Module, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
) -> Any:
    captured = getattr(_capturing, "loads", None)
    if captured is None:  # not capturing in this thread: the method that was there before
        return _saved(module, state_dict, strict=strict, assign=assign)
    state = dict(state_dict)
    captured.append((module, state))
    expected = set(module.state_dict().keys())
    return torch.nn.modules.module._IncompatibleKeys(sorted(expected - set(state)), sorted(set(state) - expected))


@contextmanager
def capture_state_dict_loads() -> Iterator[list[tuple[torch.nn.Module, dict[str, torch.Tensor]]]]:
    """Within this context, in this thread, ``Module.load_state_dict`` records ``(module, state_dict)`` and
    copies nothing; it returns what torch would (missing and unexpected keys), so callers behave as usual.

    The method is replaced only while a context is open (in any thread) and put back when the last one closes.
    Meanwhile, other threads and code outside the context get the method that was there before, unchanged
    (ComfyUI's server, other packs). If another library wraps the method while a context is open, its wrapper
    stays when the contexts close (removing it would undo that library's change); ours then passes every call
    through, as outside a context.
    """
    global _active, _saved, _beneath
    with _lock:
        if _active == 0 and not _beneath:
            _saved = torch.nn.Module.load_state_dict
            torch.nn.Module.load_state_dict = _load_state_dict
        _active += 1
    previous = getattr(_capturing, "loads", None)
    _capturing.loads = []
    try:
        yield _capturing.loads
    finally:
        _capturing.loads = previous
        with _lock:
            _active -= 1
            if _active == 0 and not _beneath:
                if torch.nn.Module.load_state_dict is _load_state_dict:
                    torch.nn.Module.load_state_dict = _saved
                else:
                    _beneath = True


def made_here(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, tagged as its own source: a value the loader makes rather than reads (a tokenizer rebuilt from
    a GGUF's metadata, where a safetensors file holds it as a tensor), given to the host beside the stand-ins."""
    setattr(tensor, _TAG, ("made", lambda: tensor, (), {}))
    return tensor


def source_of(value: torch.Tensor, read: Callable[[str], torch.Tensor]) -> Source | None:
    """Where a captured value comes from: a file tensor name, or a replay function; ``None`` if unknown.

    Args:
        value: what the host passed to ``load_state_dict`` for one key.
        read: reads a file tensor by name (in its stored dtype, on the host).
    """
    recipe = getattr(value, _TAG, None)
    if recipe is None:
        return None
    if recipe[0] == "file":
        return recipe[1]
    return lambda: _replay(recipe, read, {})


def _replay(recipe: tuple, read: Callable[[str], torch.Tensor], cache: dict[str, torch.Tensor]) -> Any:
    kind = recipe[0]
    if kind == "file":
        name = recipe[1]
        if name not in cache:
            cache[name] = read(name)
        return cache[name]
    if kind == "item":
        return _replay(recipe[1], read, cache)[recipe[2]]
    _, func, args, kwargs = recipe

    def real(item: Any) -> Any:
        if isinstance(item, torch.Tensor) and hasattr(item, _TAG):
            return _replay(getattr(item, _TAG), read, cache)
        return item

    return func(*tree_map(real, args), **tree_map(real, kwargs))
