"""Host slabs: the weights a ring carries, packed group by group into one block of host memory each.

One block per group means one page-locking per group (not per tensor: each registration is a driver call) and one
copy per group to the device. Host registration is page-granular: registering a range that touches a page already
registered fails, and CUDA reports that failure at the next kernel ("already mapped"). So a slab starts on a page
and is sized to whole pages of the host's page size (``core.devices.host_memory``: 4 KiB, 16 KiB or 64 KiB; two
slabs never share one), and each tensor in it starts on a page of its own: when
the slab is unlocked (its model offloaded), ComfyUI may page-lock the weights one by one, and no two of them then
share a page either. Each weight becomes a view of its slab, so
host memory is not doubled; its place (offset, dtype, shape) is the same in the slab and in a ring slot, so a
layer's views of every slot are made once (``core.placement.ring``). A slab stays its weights' home when their model
leaves the device (unlocked, so no memory stays page-locked for an offloaded model) and is locked again when the
next plan streams the same group: packing copies the weights once, not at every load and offload, which a long run
of loads and offloads would otherwise pay in RAM the allocator keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..devices.backends import Target, backend_of, target_of
from ..devices.host_memory import page_block, page_size
from ..devices.pinned import pinned_memory
from ..devices.slices import SLICES
from ..devices.transfer import CASTS_ANYWHERE

#: In a slab on a donor device (no page to lock), offsets are aligned for vectorised loads only.
DEVICE_ALIGN = 16


@dataclass(frozen=True)
class Part:
    """One tensor of a group: where it lies in the group's slab (and in a slot), its dtype and shape."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size

    def view(self, block: torch.Tensor) -> torch.Tensor:
        """This tensor's bytes in ``block`` (a slab or a slot), as a tensor of its dtype and shape."""
        return block.narrow(0, self.offset, self.nbytes).view(self.dtype).view(self.shape)


@dataclass(eq=False)
class Slab:
    """Layers that cross together: their block in host memory, its size, and whether it is page-locked."""

    modules: list[torch.nn.Module]
    block: torch.Tensor
    nbytes: int
    pinned: bool  # copies from it need no host work: page-locked host memory, or a donor device's memory
    #: Tensors start at multiples of this many bytes (0: the host's page, ``core.devices.host_memory``).
    align: int = 0

    def lock(self, target: Target) -> None:
        """Page-lock the block again (it was unlocked when its model left the device), where the cap allows."""
        if not self.pinned:
            self.pinned = pinned_memory().lock(self.block, target)

    def unlock(self) -> None:
        """Unlock the block; its weights keep living in it, as pageable memory (no copy, nothing freed)."""
        if self.pinned and backend_of(target_of(self.block)).is_host:
            pinned_memory().unlock(self.block)
            self.pinned = False


def groupable(module: torch.nn.Module) -> bool:
    """Whether ``module``, streamed whole, can be carried by a ring: its cast asks for its weight and bias through
    ``core.weights.casting`` (the pack's cast layers), not through code of its own."""
    return bool(getattr(type(module), CASTS_ANYWHERE, False))


def tensors_of(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors a ring carries for ``module``: its weight and bias (what its cast uses)."""
    found = []
    for name in ("weight", "bias"):
        tensor = module._parameters.get(name)
        if tensor is not None:
            found.append((name, tensor))
    return found


def layer_bytes(module: torch.nn.Module) -> int:
    """The bytes ``module``'s weight and bias take in a host slab, and so in a ring slot: each on pages of its own."""
    return sum(aligned(tensor.numel() * tensor.element_size()) for _name, tensor in tensors_of(module))


def carried_bytes(module: torch.nn.Module) -> int:
    """The bytes ``module``'s weight and bias take in a slab where they are now, and so in a ring slot: on pages of
    their own in host memory, aligned for vectorised loads in a donor device's memory."""
    tensors = tensors_of(module)
    align = _align_of(tensors[0][1]) if tensors else None
    return sum(aligned(tensor.numel() * tensor.element_size(), align) for _name, tensor in tensors)


def piece_bytes(module: torch.nn.Module) -> int:
    """The most bytes one computation of a streamed layer copies, as its slab holds them: the whole layer, or,
    streamed in row slices, its largest slice with its bias."""
    slices = module.__dict__.get(SLICES)
    if slices is None:
        return carried_bytes(module)
    weight, bias = module._parameters["weight"], module._parameters.get("bias")
    align = _align_of(weight)
    row = weight.numel() // weight.size(0) * weight.element_size()
    return aligned(slices.largest * row, align) + (
        0 if bias is None else aligned(bias.numel() * bias.element_size(), align)
    )


def _align_of(tensor: torch.Tensor) -> int:
    """What a slab aligns ``tensor`` to where it lives: a page in host memory, a vector in a donor device's."""
    return page_size() if backend_of(target_of(tensor)).is_host else DEVICE_ALIGN


def bias_first(module: torch.nn.Module) -> bool:
    """Whether ``module``'s bias lies before its weight (how a layer streamed in row slices is packed)."""
    weight, bias = module._parameters["weight"], module._parameters.get("bias")
    return bias is None or bias.data_ptr() < weight.data_ptr()


def aligned(nbytes: int, align: int | None = None) -> int:
    """``nbytes`` rounded up to a multiple of ``align`` (default: the host's page, what a slab's tensors start on,
    which also keeps them aligned for vectorised kernels)."""
    align = align or page_size()
    return -(-nbytes // align) * align


def in_slab_tensor(tensor: torch.Tensor, slab: torch.Tensor) -> bool:
    return slab.data_ptr() <= tensor.data_ptr() < slab.data_ptr() + slab.numel()


def parts_of(module: torch.nn.Module, slab: torch.Tensor) -> tuple[Part | None, Part | None]:
    """Where ``module``'s weight and bias lie in ``slab``."""
    parts: dict[str, Part] = {}
    for name, tensor in tensors_of(module):
        offset = tensor.data_ptr() - slab.data_ptr()
        parts[name] = Part(offset, tensor.numel() * tensor.element_size(), tensor.dtype, tensor.size())
    return parts.get("weight"), parts.get("bias")


def pack(modules: list[torch.nn.Module], target: Target, *, bias_first: bool = False) -> Slab:
    """A new slab holding ``modules``' weights and biases where they are now (host memory, page-locked where the
    backend and the cap allow; a donor device's memory for a split model's donor), each tensor becoming a view of it
    (its own memory is freed when nothing else holds it). ``bias_first``: a layer streamed in row slices, whose bias
    crosses with its first slice, so bias and first rows are one range."""
    home = target_of(tensors_of(modules[0])[0][1])
    backend = backend_of(home)
    align = page_size() if backend.is_host else DEVICE_ALIGN
    size = sum(aligned(tensor.numel() * tensor.element_size(), align) for m in modules for _n, tensor in tensors_of(m))
    slab = page_block(size) if backend.is_host else backend.empty(home, torch.Size([size]), torch.uint8)
    pinned = pinned_memory().lock(slab, target) if backend.is_host else True  # device memory needs no host
    offset = 0
    for module in modules:
        for _name, tensor in sorted(tensors_of(module), key=lambda item: bias_first and item[0] == "weight"):
            nbytes = tensor.numel() * tensor.element_size()
            part = Part(offset, nbytes, tensor.dtype, tensor.size())
            view = part.view(slab)
            view.copy_(tensor.data)
            tensor.data = view
            offset += aligned(nbytes, align)
    return Slab(list(modules), slab, size, pinned, align=align)
