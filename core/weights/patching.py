"""Applying weight patches (LoRAs and friends) to weights, resident or streamed, and checking them when added.

* :func:`check_patch` refuses a patch when it is added (an unknown type, NaN or infinite values), naming its
  source and the weight, instead of failing or poisoning the image halfway through sampling.
* Resident weights are patched in float32 and rounded back to their stored dtype with :func:`round_to`
  (stochastically for fp8, seeded per weight name by :func:`key_seed`, so the result is reproducible);
  :func:`get_weight` and :func:`set_weight` read and replace them, so the owner can keep the originals and put
  the very same tensors back (an exact restore).
* :class:`OnTheFlyPatch` applies the same patches to a weight that is not resident, each time it is cast for
  a computation (the ``weight_function`` path), so a LoRA gives the same result resident or streamed; to a
  weight streamed in row slices, slice by slice where the patches allow it (``core.weights.patch_rows``).

The owner is ComfyUI's model patcher (``nodes/bridge/patcher.py``), through the protocol ComfyUI's own uses.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..devices.backends import backend_of, target_of
from ..errors import PatchError
from .patch_factors import FactorBank, PlacedPatches, place_patches
from .patch_math import Patch, calculate_weight, patch_kind
from .patch_rows import patches_for_rows, row_multiple

log = logging.getLogger("device_control")

COMPUTABLE = (torch.float32, torch.float16, torch.bfloat16)
_FP8 = {
    getattr(torch, "float8_e4m3fn", None): (4, 3, 7),  # exponent bits, mantissa bits, exponent bias
    getattr(torch, "float8_e5m2", None): (5, 2, 15),
}


def key_seed(key: str) -> int:
    """The seed for stochastic rounding of weight ``key``: the CRC-32 of its name (ComfyUI uses the same)."""
    return zlib.crc32(key.encode("latin-1", errors="replace"))


def _stochastic_fp8(value: torch.Tensor, dtype: torch.dtype, noise: torch.Tensor) -> torch.Tensor:
    """Round to fp8 up or down at random, in proportion to closeness (unbiased on average).

    ``noise`` holds one value in [0, 1) per element (fp16): where it falls decides the direction.
    """
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
    scaled += noise
    magnitude[:] = scaled.floor() / (2**mantissa_bits)
    sign *= torch.where(normal, (2.0 ** (exponent - bias)) * (1.0 + magnitude), (2.0 ** (-bias + 1)) * magnitude)
    limits = torch.finfo(dtype)
    torch.clamp(sign, min=limits.min, max=limits.max, out=sign)
    return sign


#: How the random draws of fp8 stochastic rounding are made, as the host application makes them, so a patched
#: fp8 weight is bit-identical to its own (checked against comfy-kitchen's CPU implementation, not its CUDA one):
#: ``uniform``, an fp16 uniform draw per value, drawn per block of 16M values (ComfyUI before comfy-kitchen's
#: rounding); ``bytes``, one random byte per value for the whole tensor, scaled by 1/256 (ComfyUI 0.2x with
#: comfy-kitchen).
FP8_NOISE = ("uniform", "bytes")


def round_to(value: torch.Tensor, dtype: torch.dtype, seed: int = 0, noise: str = "uniform") -> torch.Tensor:
    """``value`` in ``dtype``: a plain cast, or seeded stochastic rounding for fp8 (draws made as ``noise`` says,
    one of :data:`FP8_NOISE`)."""
    if dtype not in _FP8:
        return value.to(dtype=dtype)
    generator = torch.Generator(device=value.device)
    generator.manual_seed(seed)
    # One byte per value for the whole tensor, drawn at once (the draws' order is the host's); the rounding
    # itself runs in row blocks of about 16M values either way, so its fp16 temporaries stay small.
    whole = None
    if noise == "bytes":
        whole = torch.randint(0, 256, value.size(), dtype=torch.uint8, device=value.device, generator=generator)
    out = torch.empty_like(value, dtype=dtype)
    rows = max(1, round(value.shape[0] / max(1, value.numel() / (4096 * 4096))))
    for start in range(0, value.shape[0], rows):
        block = value[start : start + rows]
        if whole is not None:
            draws = whole[start : start + rows].to(torch.float16) * (1.0 / 256.0)
        else:
            draws = torch.rand(block.size(), dtype=torch.float16, device=value.device, generator=generator)
        out[start : start + rows].copy_(_stochastic_fp8(block, dtype, draws))
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


def check_patch(key: str, value: Any, source: str) -> None:
    """Refuse a patch now, when it is added, rather than halfway through sampling.

    Args:
        key: the weight it patches (``diffusion_model.input_blocks.1.1.proj_in.weight``).
        value: the patch value, as ``ModelPatcher.add_patches`` receives it.
        source: what the patch comes from, for the message (``LoRA 'detail.safetensors'``).

    Raises:
        PatchError: a patch of a type we do not apply, or one with NaN or infinite values (it would turn the
            weight, and then the image, into NaN).
    """
    try:
        patch_kind(value)
    except PatchError as exc:
        raise PatchError(f"{source}, patch for {key}: {exc}") from None
    if not _finite(value):
        from_key = sorted(getattr(value, "loaded_keys", ()) or ())
        named = f" (LoRA key {from_key[0]})" if from_key else ""
        raise PatchError(
            f"{source} has NaN or infinite values in its patch for {key}{named}: the file is damaged. Download it "
            "again, or remove it from the workflow."
        )


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

    The patches' factors cross to the device the weight computes on once, the first time it computes there, and
    stay there with this function (``core.weights.patch_factors``): not a blocking copy at every forward.

    Args:
        key: the weight's name.
        patches: the patch dictionary (shared: patches added later apply too).
        storage_dtype: the dtype the layer stores this weight in.
        convert_func / set_func: the layer's own conversion hooks, when it stores weights in a special form.
        fp8_noise: how fp8 rounding draws its noise, as the host application does (:data:`FP8_NOISE`).
    """

    def __init__(
        self,
        key: str,
        patches: Mapping[str, list[Patch]],
        storage_dtype: torch.dtype | None = None,
        convert_func: Callable | None = None,
        set_func: Callable | None = None,
        fp8_noise: str = "uniform",
    ) -> None:
        self.key = key
        self.patches = patches
        self.storage_dtype = storage_dtype
        self.convert_func = convert_func
        self.set_func = set_func
        self.fp8_noise = fp8_noise
        #: Its factors where its weight computes (``core.weights.patch_factors``), placed by itself or its bank.
        self.placed: PlacedPatches | None = None
        #: The load's bank it places its factors through, with the others' (``FactorBank.join`` sets it).
        self.bank: FactorBank | None = None

    def current(self) -> list[Patch]:
        """This weight's patches as they are now (the dictionary is shared: patches added later apply too)."""
        return self.patches.get(self.key, [])

    def _patches_for(self, weight: torch.Tensor) -> list[Patch]:
        """This weight's patches with their factors where ``weight`` computes (copied there once, with those of its
        bank's other patches, and again only when the patches changed or the weight computes elsewhere)."""
        patches = self.patches[self.key]
        target = target_of(weight)
        placed = self.placed
        if placed is not None and placed.serves(patches, target):
            return placed.patches
        if backend_of(target).is_host:
            return patches
        if self.bank is not None:
            return self.bank.place(self, target).patches
        self.placed = None  # the old copy goes before the new one is made
        self.placed = place_patches(patches, target)
        return self.placed.patches

    def slice_multiple(self, shape: tuple[int, ...]) -> int | None:
        """The multiple of rows on which slices of this weight (of ``shape``) must start for :meth:`rows` to give
        exactly those rows of the patched weight; ``None`` when only the whole weight can be patched: a weight
        stored in a special form, or in fp8 (its stochastic rounding draws noise for the whole tensor at once),
        or patches that need every row (``core.weights.patch_rows``)."""
        if self.storage_dtype not in COMPUTABLE or self.convert_func is not None or self.set_func is not None:
            return None
        return row_multiple(self.patches[self.key], shape)

    def rows(self, weight: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of the weight (``weight``: those rows, cast) patched: bit for bit the same rows of
        the whole weight patched, on slices :meth:`slice_multiple` allowed."""
        patches = patches_for_rows(self._patches_for(weight), start, stop)
        patched = calculate_weight(patches, weight.to(torch.float32, copy=True), self.key)
        return round_to(patched, self.storage_dtype, key_seed(self.key), self.fp8_noise).to(weight.dtype)

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        dtype = weight.dtype
        patches = self._patches_for(weight)
        if self.storage_dtype is not None and self.convert_func is None and self.set_func is None:
            patched = calculate_weight(patches, weight.to(torch.float32, copy=True), self.key)
            return round_to(patched, self.storage_dtype, key_seed(self.key), self.fp8_noise).to(dtype)
        if self.convert_func is not None:
            weight = self.convert_func(weight, inplace=False)
        if dtype not in COMPUTABLE:
            out = calculate_weight(patches, weight.to(torch.float32), self.key, torch.float32)
            if self.set_func is None:
                return round_to(out, weight.dtype, key_seed(self.key), self.fp8_noise)
            return self.set_func(out, seed=key_seed(self.key), return_weight=True)
        out = calculate_weight(patches, weight, self.key, intermediate_dtype=dtype)
        if self.set_func is not None:
            return self.set_func(out, seed=key_seed(self.key), return_weight=True).to(dtype=dtype)
        return out
