"""Weight patch sets: add LoRAs and friends, apply them to a module tree, restore it bit for bit.

* :class:`PatchSet` holds patches by weight name in ComfyUI's format. Cloning is cheap (the patch tensors are
  shared, the lists are not) and its ``uuid`` changes whenever its patches do, so a model knows when the
  patches it was built with are stale.
* :meth:`PatchSet.apply` patches resident weights: each original tensor is kept as it is (the backup) and
  replaced by a patched one computed in float32 and rounded back to the stored dtype (stochastically for fp8,
  seeded per weight name, so the result is reproducible). :meth:`PatchSet.restore` puts the originals back:
  the very same tensors, so the restore is exact.
* :class:`OnTheFlyPatch` applies the same patches to a weight that is not resident, each time it is cast for
  a computation (the ``weight_function`` path), so a LoRA gives the same result resident or streamed.
"""

from __future__ import annotations

import logging
import uuid
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .patch_math import Patch, calculate_weight, patch_kind

log = logging.getLogger("device_control")

COMPUTABLE = (torch.float32, torch.float16, torch.bfloat16)
_FP8 = {
    getattr(torch, "float8_e4m3fn", None): (4, 3, 7),  # exponent bits, mantissa bits, exponent bias
    getattr(torch, "float8_e5m2", None): (5, 2, 15),
}


def key_seed(key: str) -> int:
    """The seed for stochastic rounding of weight ``key``: the CRC-32 of its name (ComfyUI uses the same)."""
    return zlib.crc32(key.encode("latin-1", errors="replace"))


def _stochastic_fp8(value: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Round to fp8 up or down at random, in proportion to closeness (unbiased on average)."""
    exponent_bits, mantissa_bits, bias = _FP8[dtype]
    value = value.half()
    sign = torch.sign(value)
    magnitude = value.abs()
    sign = torch.where(magnitude == 0, 0, sign)
    exponent = torch.clamp(torch.floor(torch.log2(magnitude)) + bias, 0, 2**exponent_bits - 1)
    normal = ~(exponent == 0)
    scaled = torch.where(
        normal,
        (magnitude / (2.0 ** (exponent - bias)) - 1.0) * (2**mantissa_bits),
        magnitude / (2.0 ** (-bias + 1 - mantissa_bits)),
    )
    scaled += torch.rand(
        scaled.size(), dtype=scaled.dtype, layout=scaled.layout, device=scaled.device, generator=generator
    )
    magnitude[:] = scaled.floor() / (2**mantissa_bits)
    sign *= torch.where(normal, (2.0 ** (exponent - bias)) * (1.0 + magnitude), (2.0 ** (-bias + 1)) * magnitude)
    limits = torch.finfo(dtype)
    torch.clamp(sign, min=limits.min, max=limits.max, out=sign)
    return sign


def round_to(value: torch.Tensor, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """``value`` in ``dtype``: a plain cast, or seeded stochastic rounding for fp8 (row blocks of 16M values)."""
    if dtype not in _FP8:
        return value.to(dtype=dtype)
    generator = torch.Generator(device=value.device)
    generator.manual_seed(seed)
    out = torch.empty_like(value, dtype=dtype)
    rows = max(1, round(value.shape[0] / max(1, value.numel() / (4096 * 4096))))
    for start in range(0, value.shape[0], rows):
        out[start : start + rows].copy_(_stochastic_fp8(value[start : start + rows], dtype, generator))
    return out


def _parameter_path(module: torch.nn.Module, key: str) -> tuple[torch.nn.Module, str]:
    path, _, name = key.rpartition(".")
    return (module.get_submodule(path) if path else module), name


def get_weight(module: torch.nn.Module, key: str) -> torch.Tensor:
    """The parameter or buffer ``key`` of ``module``."""
    owner, name = _parameter_path(module, key)
    return getattr(owner, name)


def set_weight(module: torch.nn.Module, key: str, value: torch.Tensor) -> None:
    """Replace parameter (or buffer) ``key`` of ``module`` with ``value``."""
    owner, name = _parameter_path(module, key)
    if name in owner._parameters:
        owner._parameters[name] = (
            value if isinstance(value, torch.nn.Parameter) else torch.nn.Parameter(value, requires_grad=False)
        )
    else:
        owner._buffers[name] = value


@dataclass
class PatchSet:
    """Patches by weight name, in ComfyUI's tuple format."""

    patches: dict[str, list[Patch]] = field(default_factory=dict)
    uuid: uuid.UUID = field(default_factory=uuid.uuid4)

    def add(
        self,
        patches: Mapping[Any, Any],
        strength_patch: float = 1.0,
        strength_model: float = 1.0,
        known: Iterable[str] | None = None,
    ) -> set[str]:
        """Add patches (as ``ModelPatcher.add_patches`` takes them); return the keys that were added.

        A key may be a name, ``(name, offset)`` or ``(name, offset, function)``. Keys not in ``known`` (when
        given) are skipped. Patch tensors with NaN or infinity are reported: they would poison the weights.

        Raises:
            PatchError: a patch of an unknown type.
        """
        allowed = set(known) if known is not None else None
        added = set()
        poisoned = []
        for raw_key, value in patches.items():
            name, offset, function = _split_key(raw_key)
            if allowed is not None and name not in allowed:
                continue
            patch_kind(value)  # refuse what we cannot apply now, not halfway through sampling
            if not _finite(value):
                poisoned.append(name)
            self.patches.setdefault(name, []).append((strength_patch, value, strength_model, offset, function))
            added.add(name)
        if poisoned:
            log.warning(
                "[Device Control] %d patched weights have NaN or infinite values in their patch (e.g. %s): "
                "those weights will be NaN; the LoRA file is damaged",
                len(poisoned),
                poisoned[0],
            )
        if added:
            self.uuid = uuid.uuid4()
        return added

    def clone(self) -> PatchSet:
        """A copy whose lists are its own and whose tensors are shared."""
        return PatchSet({key: list(value) for key, value in self.patches.items()}, self.uuid)

    def apply(self, module: torch.nn.Module, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """Patch every weight of ``module`` that has patches; return the originals (the backup)."""
        backup = {}
        for key, patches in self.patches.items():
            weight = get_weight(module, key)
            backup[key] = weight
            work = weight.detach().to(device=device or weight.device, dtype=torch.float32, copy=True)
            patched = calculate_weight(patches, work, key)
            set_weight(module, key, round_to(patched, weight.dtype, key_seed(key)))
        return backup

    @staticmethod
    def restore(module: torch.nn.Module, backup: Mapping[str, torch.Tensor]) -> None:
        """Put the original tensors back (the same objects: bit for bit what was there)."""
        for key, original in backup.items():
            set_weight(module, key, original)

    def on_the_fly(self, key: str) -> OnTheFlyPatch:
        """A callable that patches weight ``key`` each time it is cast for a computation."""
        return OnTheFlyPatch(key, self.patches)


def _split_key(raw: Any) -> tuple[str, Any, Callable | None]:
    if isinstance(raw, str):
        return raw, None, None
    return raw[0], raw[1], raw[2] if len(raw) > 2 else None


def _finite(value: Any) -> bool:
    tensors = getattr(value, "weights", value)
    stack = list(tensors) if isinstance(tensors, (tuple, list)) else [tensors]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor) and item.is_floating_point() and not torch.isfinite(item).all():
            return False
        if isinstance(item, (tuple, list)):
            stack.extend(item)
    return True


class OnTheFlyPatch:
    """Patches a weight as it is cast for a computation (for layers whose weights stream).

    With ``storage_dtype`` (how the layer stores its weight), the patch is computed exactly as for a resident
    weight: in float32, rounded to the storage dtype with the weight's seed, then brought to the compute
    dtype. A LoRA then gives bit-identical results resident or streamed, and patch types whose math needs
    float32 (OFT, BOFT) apply when streamed too. Without it, the math runs in the incoming dtype (float32,
    fp16 or bf16; fp8 in float32 with stochastic rounding back), as ComfyUI's own low-VRAM patch does.

    Args:
        key: the weight's name.
        patches: the patch dictionary (shared: patches added later apply too).
        storage_dtype: the dtype the layer stores this weight in.
        convert_func / set_func: the layer's own conversion hooks, when it stores weights in a special form.
    """

    def __init__(
        self,
        key: str,
        patches: Mapping[str, list[Patch]],
        storage_dtype: torch.dtype | None = None,
        convert_func: Callable | None = None,
        set_func: Callable | None = None,
    ) -> None:
        self.key = key
        self.patches = patches
        self.storage_dtype = storage_dtype
        self.convert_func = convert_func
        self.set_func = set_func

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        dtype = weight.dtype
        if self.storage_dtype is not None and self.convert_func is None and self.set_func is None:
            patched = calculate_weight(self.patches[self.key], weight.to(torch.float32, copy=True), self.key)
            return round_to(patched, self.storage_dtype, key_seed(self.key)).to(dtype)
        if self.convert_func is not None:
            weight = self.convert_func(weight, inplace=False)
        if dtype not in COMPUTABLE:
            out = calculate_weight(self.patches[self.key], weight.to(torch.float32), self.key, torch.float32)
            if self.set_func is None:
                return round_to(out, weight.dtype, key_seed(self.key))
            return self.set_func(out, seed=key_seed(self.key), return_weight=True)
        out = calculate_weight(self.patches[self.key], weight, self.key, intermediate_dtype=dtype)
        if self.set_func is not None:
            return self.set_func(out, seed=key_seed(self.key), return_weight=True).to(dtype=dtype)
        return out
