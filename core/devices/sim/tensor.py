"""The tensors of a simulated GPU: a ``torch.Tensor`` subclass that stays in host memory but computes "on" its
device.

Every operation that touches a :class:`SimTensor` runs on the host data and its result is placed on the same
simulated device (counted in its books). Computing with a tensor on one simulated device and a *weight*
(``nn.Parameter``) that is on the host and not marked as streamed (``core.devices.marks``) raises the
``RuntimeError`` a real device mismatch raises, so a forgotten move fails in tests. Other host tensors count
as uploaded inputs. ``.cpu()`` and ``.to("cpu")`` give plain host tensors.

A tensor copied on a side stream carries the stream position of its copy (``_sim_pending``); computing with
it on a stream that has not waited for that position raises (``core.devices.sim.link``).

A copy shares host memory with what it was copied from, where a real device's copy is a snapshot: a write to
the source after the copy was made would reach the copy here and never on a real device. So a copy carries a
sample of its values (:func:`take_snapshot`), and its first computation raises if they changed since: the
product used a copy of a weight that was rewritten in place after the copy was queued.

Before its own work, every operation on the device raises what the device left pending for it (a failed host
registration's error, a queued copy's source freed: ``core.devices.sim.host``), as CUDA's launch check does.

The device is any object with ``label``, ``link``, ``raise_pending()`` and ``_register(tensor)``
(``core.devices.sim.device``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..marks import is_streamed
from ..reported import plain_class, reported_shape

if TYPE_CHECKING:
    from .link import Link
    from .slots import Slots


class Holder(Protocol):
    """What a simulated tensor asks of the device it lives on (``core.devices.sim.device.SimulatedDevice``): its
    label, its link (streams, the compute clock), the slots a ring fills, and its books. Named here, so that the
    device may make tensors and a tensor know its device without the two modules importing each other."""

    label: str
    link: Link
    slots: Slots

    def _register(self, tensor: torch.Tensor) -> None: ...

    def raise_pending(self) -> None: ...

    def check_landing(self, tensor: torch.Tensor) -> None: ...


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item)


def _is_stranded_weight(tensor: torch.Tensor) -> bool:
    """A host parameter used in a device computation without being streamed: a forgotten move."""
    return isinstance(tensor, torch.nn.Parameter) and tensor.dim() > 0 and not is_streamed(tensor)


#: Functions that move data between the host and a device, where mixing devices is the point.
_TRANSFERS = {torch.Tensor.copy_, torch.Tensor.to, torch.Tensor.cpu}
#: Functions that give the host a value computed on the device: the host waits for the device's computations.
_VALUE_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__}


def _read_on_host(device: Holder | None) -> None:
    """The host reads a value from ``device`` (or copies a tensor to host memory): it waits for the computations
    queued before (``core.devices.sim.link.ComputeClock``), as a real host waits for its GPU."""
    if device is not None:
        device.link.compute.wait()


def _computed(func: Any, args: tuple, kwargs: dict, device: Holder | None) -> Any:
    """``func``'s result, computed on the host; where it is work on ``device``'s compute stream, the time it took is
    the device's (the host goes on as a real one would), and a value read waits for that work first."""
    if func in _VALUE_READS:
        _read_on_host(device)
    started = time.monotonic()
    result = func(*args, **kwargs)
    if device is not None and device.link.current is device.link.main:
        device.link.compute.computed(time.monotonic() - started)
    return result


class SimTensor(torch.Tensor):
    """A tensor resident on a :class:`SimulatedDevice` (its data lives in host memory)."""

    _sim_device: Holder

    @property
    def sim_device(self) -> Holder:
        """The simulated device this tensor is on."""
        return self._sim_device

    @property
    def shape(self) -> torch.Size:
        """Its shape, or the one it reports instead (a quantised weight's: ``core.devices.reported``), as the
        same tensor on a real device does."""
        return reported_shape(self)

    @property
    def placement_target(self) -> Holder:
        """Where the tensor is, for code that serves every backend (``core.devices.backends.target_of``)."""
        return self._sim_device

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _DATA and func.__name__ == "__set__":
            return _set_data(*args)
        with torch._C.DisableTorchFunctionSubclass():
            device = _common_device(func, args, kwargs)
            if func is torch.Tensor.cpu or (func is torch.Tensor.to and _to_names_a_device(args, kwargs)):
                _read_on_host(device)
                source = args[0].as_subclass(torch.Tensor)
                return func(source, *args[1:], **kwargs).clone()
            result = _computed(func, args, kwargs, device)
            if kwargs.get("device") is not None:  # e.g. empty_like(x, device="cpu"): the caller named a torch device
                return result
            return _wrap(result, device)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        with torch._C.DisableTorchFunctionSubclass():
            inner = torch.Tensor.__repr__(self.as_subclass(torch.Tensor))
        return f"{inner[:-1]}, sim_device='{self._sim_device.label}')"


_DATA = torch._C.TensorBase.__dict__["data"]  # the descriptor (each ``.__set__`` lookup is a new wrapper)


def _set_data(tensor: SimTensor, data: torch.Tensor) -> None:
    """``tensor.data = data`` (how ``Module.to`` moves parameters): the books follow the data.

    Data from another place ends this tensor's stay on its device: the old storage is released now and the
    object becomes the plain tensor (or parameter) it would be on that device.
    """
    device = tensor._sim_device
    with torch._C.DisableTorchFunctionSubclass():
        _DATA.__set__(tensor, data)
        tensor._sim_release()  # the old storage is no longer this tensor's
        if isinstance(data, SimTensor) and data.sim_device is device:
            device._register(tensor)
        else:
            tensor.__class__ = original_class(tensor)
            del tensor._sim_device


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on a storage of its own bytes, sharing the memory (no copy): the device books storages, and a
    contiguous view of part of a larger block (a weight in a slab, a row slice) must count as what it is."""
    storage = tensor.untyped_storage()
    size = tensor.numel() * tensor.element_size()
    if storage.nbytes() == size or not tensor.is_contiguous():
        return tensor
    start = tensor.storage_offset() * tensor.element_size()
    return torch.empty(0, dtype=tensor.dtype).set_(storage[start : start + size], 0, tensor.size(), tensor.stride())


def original_class(tensor: torch.Tensor) -> type:
    """The class ``tensor`` had before a simulated device took it (a parameter's own subclass included), or the
    one a tensor made on the device takes on the host."""
    return tensor.__dict__.get("_sim_class") or plain_class(tensor)


def _common_device(func: Any, args: tuple, kwargs: dict) -> Holder | None:
    """The one simulated device the operands are on; raise as a real device mismatch would for a weight."""
    device: Holder | None = None
    stranded: torch.Tensor | None = None
    for tensor in _tensors_in((args, kwargs)):
        if isinstance(tensor, SimTensor):
            other = tensor._sim_device
            if device is not None and other is not device:
                _raise_mismatch(device.label, other.label)
            device = other
            _check_copy(tensor)
        elif _is_stranded_weight(tensor):
            stranded = tensor
    if device is not None and stranded is not None and func not in _TRANSFERS:
        _raise_mismatch(device.label, str(stranded.device))
    if device is not None:
        device.raise_pending()  # a failed call's error, or a fault, left for the next operation to report
    return device


#: How many of a copy's values :func:`take_snapshot` samples (spread over the whole tensor): a weight rewritten in
#: place (a LoRA applied or taken out) changes about all of them.
SNAPSHOT_SAMPLES = 64


def take_snapshot(copy: SimTensor) -> None:
    """Sample ``copy``'s values now (it shares host memory with its source), for its first computation to check."""
    with torch._C.DisableTorchFunctionSubclass():
        if not copy.is_contiguous() or copy.numel() == 0:
            return
        flat = copy.detach().as_subclass(torch.Tensor).reshape(-1)
        count = min(flat.numel(), SNAPSHOT_SAMPLES)
        index = torch.arange(count, dtype=torch.int64) * (flat.numel() - 1) // max(count - 1, 1)
        copy._sim_snapshot = (index, flat[index].clone())


def _check_copy(tensor: SimTensor) -> None:
    """Raise if ``tensor`` is a copy not complete on the current stream, or one whose source was written since."""
    pending = getattr(tensor, "_sim_pending", None)
    if pending is not None:
        tensor._sim_device.link.check_ready(pending, tensor._sim_device.label)
    if tensor._sim_device.slots.filled:  # buffers a streaming ring fills: checked by storage, views included
        tensor._sim_device.check_landing(tensor)
    snapshot = getattr(tensor, "_sim_snapshot", None)
    if snapshot is not None:
        _check_snapshot(tensor, snapshot)


def _check_snapshot(copy: SimTensor, snapshot: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Raise if ``copy``'s sampled values changed since it was made; checked once (its first computation)."""
    copy._sim_snapshot = None
    index, values = snapshot
    now = copy.detach().as_subclass(torch.Tensor).reshape(-1)[index]
    if not torch.equal(now.view(torch.uint8), values.view(torch.uint8)):  # bitwise: NaN equals itself
        raise RuntimeError(
            f"A copy on {copy._sim_device.label} was used after the host tensor it was copied from had been written "
            "in place: a real device computes with the values the copy was made of. Drop copies queued ahead "
            "before their sources are rewritten."
        )


def _raise_mismatch(first: str, second: str) -> None:
    raise RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {first} and {second}! "
        "(A weight was not moved to the compute device and has no cast path.)"
    )


def _to_names_a_device(args: tuple, kwargs: dict) -> bool:
    parsed = {k: v for k, v in kwargs.items() if k != "copy"}  # the parser knows every argument of .to() but copy
    device, _dtype, _non_blocking, _memory_format = torch._C._nn._parse_to(*args[1:], **parsed)
    return device is not None


def _wrap(result: Any, device: Holder | None) -> Any:
    if device is None:
        return result
    if isinstance(result, torch.Tensor):
        if isinstance(result, SimTensor) and getattr(result, "_sim_device", None) is device:
            return result
        wrapped = result.as_subclass(SimTensor)
        wrapped._sim_device = device
        device._register(wrapped)
        return wrapped
    if isinstance(result, (list, tuple)) and any(isinstance(item, torch.Tensor) for item in result):
        items = [_wrap(item, device) for item in result]
        return type(result)(items) if not hasattr(result, "_fields") else type(result)(*items)
    return result
