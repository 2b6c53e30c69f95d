"""ComfyUI's books for a model split over several GPUs: one entry in ``current_loaded_models`` per other device.

ComfyUI lists a split model once, on its load device (the allocation's first device). Its ``free_memory(device)``
only asks the entries filed under ``device``, so without more a ComfyUI load onto the second GPU (its multi-GPU
clones, another pack's node, our own Move To GPU, which lets ComfyUI make room on the devices it manages) could
never evict the part that sits there: it would load with less memory instead. So each other device that ComfyUI
manages gets an entry of its own, a :class:`SplitPartEntry` wrapping a :class:`SplitPart`: a patcher that owns no
weights, whose size is the part's bytes and whose loaded size is what that very split still holds there. When
ComfyUI unloads it, the whole split leaves every device (through the patcher that loaded it, so patched weights
are restored) and the next sampler splits the model again.

Rules ComfyUI's list imposes: part entries are booked after a load of the split model (ComfyUI calls the
patcher's load while it holds no index into its list) and never added or removed while ComfyUI unloads (its
``free_memory`` pops entries by indices taken before its loop); a part whose split ended stays listed, holding
nothing, until the next booking or an unload the user asked for drops it, or ComfyUI pops it. The pack's own
books skip part entries (the model's entry already counts every device: ``core.placement.split_model``).
Devices ComfyUI sees as the host (the simulated GPUs) get no part entry: the pack makes room on them itself.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from ...core.devices.backends import backend_of
from ...core.devices.tensors import HOST, Target, label_of, same_target
from ...core.placement.split_model import SplitModel, split_of
from ...core.units import format_bytes
from .. import surface

log = logging.getLogger("device_control")

#: Where a split model's module tree keeps its part patchers (ComfyUI's entries hold them only weakly).
_PARTS = "_device_control_split_parts"


class _PartModule(torch.nn.Module):
    """What a part patcher wraps: no weights (ComfyUI reads its class name when it logs an unload)."""


class SplitPart(surface.model_patcher_class()):
    """The part of a split model on one device, as ComfyUI's patcher protocol sees it.

    Args:
        owner: the patcher that loaded the split (held weakly: its backups restore patched weights).
        held: the split, as it was booked.
        target: the device of this part.
        device: ComfyUI's name for that device.
    """

    #: Marks the patcher of a part entry, for readers of ComfyUI's list that must not count it twice.
    device_control_split_part = True

    def __init__(self, owner: Any, held: SplitModel, target: Target, device: torch.device) -> None:
        self._root = weakref.ref(held.root)  # first: ComfyUI's constructor asks for the size
        self._held = weakref.ref(held)
        super().__init__(_PartModule(), load_device=device, offload_device=HOST, size=held.resident_bytes(target))
        self.owner = weakref.ref(owner)
        self.target = target
        if hasattr(owner, "clone_base_uuid"):  # ComfyUI 0.28+: unloading the model with its clones takes parts too
            self.clone_base_uuid = owner.clone_base_uuid

    def root(self) -> torch.nn.Module | None:
        """The split model's module tree (``None`` once it is gone)."""
        return self._root()

    def split(self) -> SplitModel | None:
        """The split this part stands for, while it holds the model; ``None`` after it ended."""
        root, held = self._root(), self._held()
        return held if root is not None and held is not None and split_of(root) is held else None

    def model_size(self) -> int:
        return self.size if self.split() is not None else 0  # an ended split asks ComfyUI for no room

    def loaded_size(self) -> int:
        held = self.split()
        return held.resident_bytes(self.target) if held is not None else 0

    def current_loaded_device(self) -> torch.device:
        return self.load_device

    def load(self, *_args: Any, **_kwargs: Any) -> None:
        """A part is placed by its model's load, never on its own."""

    def partially_load(self, *_args: Any, **_kwargs: Any) -> int:
        return 0

    def partially_unload(self, *_args: Any, **_kwargs: Any) -> int:
        return 0  # a split leaves whole: ComfyUI then unloads the entry in full

    def model_patches_to(self, *_args: Any, **_kwargs: Any) -> None:
        return None

    def detach(self, unpatch_all: bool = True) -> None:
        if unpatch_all:
            self.release()

    def unpatch_model(self, device_to: Any = None, unpatch_weights: bool = True) -> None:
        del device_to
        if unpatch_weights:
            self.release()

    def release(self) -> int:
        """Take the whole split off every device, through the patcher that loaded it; bytes freed on devices."""
        held = self.split()
        if held is None:
            return 0
        owner = self.owner() or _live_patcher(held.root)
        if owner is None:  # no patcher of the model is left to restore its weights: free the devices anyway
            return held.release()
        log.info(
            "[Device Control] ComfyUI wants %s back: the split of %s leaves every device",
            label_of(self.target),
            type(held.root).__name__,
        )
        return owner.partially_unload(owner.offload_device, 0)


class SplitPartEntry(surface.loaded_model_class()):
    """ComfyUI's ``LoadedModel`` for a part: filed under the part's device, unloaded whole."""

    def __init__(self, part: SplitPart) -> None:
        super().__init__(part)
        self.real_model = weakref.ref(part)
        self.model_finalizer = weakref.finalize(part, surface.cleanup_models)
        self.model_finalizer.atexit = False  # as ComfyUI's own: nothing to clean at exit

    @property
    def currently_used(self) -> bool:
        """Never: callers that load ComfyUI's models in use again (``loaded_models(only_currently_used=True)``)
        must not load a part on its own; its model's entry stands for it."""
        return False

    @currently_used.setter
    def currently_used(self, _value: bool) -> None:
        return None

    def model_unload(self, memory_to_free: int | None = None, unpatch_weights: bool = True) -> bool:
        """Unload the whole split, unless its model is being loaded now: ``load_models_gpu`` takes the model's own
        entry out of the list while it makes room on every device the load needs, and the split it is loading
        must not leave a device for another model of the same load (it would be split again at once)."""
        del memory_to_free
        part = self.model
        if part is not None and part.split() is not None and _live_patcher(part.root()) is None:
            return False
        if part is not None and unpatch_weights:
            part.release()
        if self.model_finalizer is not None:
            self.model_finalizer.detach()
            self.model_finalizer = None
        return True


def _live_patcher(root: torch.nn.Module) -> Any | None:
    """A patcher of ours for ``root`` that ComfyUI still lists (its model's own entry), or ``None``."""
    for entry in surface.loaded_models():
        patcher = getattr(entry, "model", None)
        if hasattr(patcher, "device_control_split") and getattr(patcher, "model", None) is root:
            return patcher
    return None


def is_part(patcher: Any) -> bool:
    """Whether ``patcher`` stands for a part of a split model (its bytes are counted by the model's entry)."""
    return bool(getattr(patcher, "device_control_split_part", False))


def book_parts(patcher: Any) -> None:
    """After a load of ``patcher``'s split model: one part entry in ComfyUI's list per other device ComfyUI manages.

    Nothing changes when the parts booked before still stand for the split held now (the next sampler's load of
    a split in force); entries ComfyUI popped meanwhile are listed again.
    """
    listed = surface.loaded_model_list()
    for part in _standing_parts(patcher):
        if not any(entry.model is part for entry in listed):
            listed.insert(0, SplitPartEntry(part))
            log.info(
                "[Device Control] ComfyUI's books: %s of the split model on %s",
                format_bytes(part.loaded_size()),
                part.load_device,
            )


def _standing_parts(patcher: Any) -> tuple[SplitPart, ...]:
    """The parts of the split that holds ``patcher``'s model now: those booked for it, else new ones (the parts
    of an ended split are dropped)."""
    root = patcher.model
    held = split_of(root)
    if held is None:
        drop_parts(root)
        return ()
    parts = tuple(part for part in root.__dict__.get(_PARTS, ()) if part.split() is held)
    if not parts:
        drop_parts(root)
        parts = _new_parts(patcher, held)
        root.__dict__[_PARTS] = parts
    for part in parts:  # the latest patcher to load the split restores its weights when a part is unloaded
        part.owner = weakref.ref(patcher)
    return parts


def _new_parts(patcher: Any, held: SplitModel) -> tuple[SplitPart, ...]:
    """A part for each device of ``held`` that ComfyUI manages, other than ``patcher``'s load device."""
    parts = []
    for target in held.targets.values():
        if same_target(target, HOST) or not backend_of(target).comfy_makes_room:
            continue
        device = backend_of(target).comfy_device(target)
        if device == patcher.load_device or device.type == "cpu" or held.resident_bytes(target) == 0:
            continue
        parts.append(SplitPart(patcher, held, target, device))
    return tuple(parts)


def drop_parts(root: torch.nn.Module) -> None:
    """Take ``root``'s part entries out of ComfyUI's list (never while ComfyUI unloads: it holds indices then)."""
    parts = root.__dict__.pop(_PARTS, ())
    listed = surface.loaded_model_list()
    for entry in [entry for entry in listed if any(entry.model is part for part in parts)]:
        listed.remove(entry)
        if entry.model_finalizer is not None:
            entry.model_finalizer.detach()
            entry.model_finalizer = None


def drop_ended_parts() -> None:
    """Take the part entries of splits that ended out of ComfyUI's list (after an unload the user asked for)."""
    for entry in surface.loaded_models():
        part = getattr(entry, "model", None)
        root = part.root() if part is not None and is_part(part) else None
        if root is not None and part.split() is None:
            drop_parts(root)
