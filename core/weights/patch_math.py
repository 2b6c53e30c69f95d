"""The arithmetic of weight patches (LoRA and its relatives), in ComfyUI's patch format.

A patch is the tuple ComfyUI's ``ModelPatcher.add_patches`` stores per weight:
``(strength_patch, value, strength_model, offset, function)``. ``value`` is either a weight adapter (an object
with ``name`` and ``weights``: LoRA, LoHa, LoKr, GLoRA, OFT, BOFT), a tuple ``("diff" | "set" | "model_as_lora",
payload)`` or a one-tuple diff, or a list (a patched model used as a patch: its first entry is the base weight
with a conversion function, the rest are its own patches).

:func:`calculate_weight` applies a list of patches to a weight *in place* (callers pass a copy), in float32
intermediates by default, and reproduces ComfyUI's results bit for bit: same operations, same order, same
dtypes. A patch that does not fit its weight is skipped with a warning naming the key, as ComfyUI does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..devices.backends import backend_of, same_target, target_of
from ..errors import PatchError

log = logging.getLogger("device_control")

Patch = tuple[float, Any, float, Any, Callable[[torch.Tensor], torch.Tensor] | None]
ADAPTERS = ("lora", "loha", "lokr", "glora", "oft", "boft")
RAW_TYPES = ("diff", "set", "model_as_lora")


def _cast(tensor: torch.Tensor, at: torch.Tensor, dtype: torch.dtype | None, copy: bool = False) -> torch.Tensor:
    """``tensor`` where ``at`` is, in ``dtype`` (a copy only when something changes, or when asked).

    A tensor elsewhere crosses through the backend of ``at``'s device, a blocking copy: the factors of an on-the-fly
    patch are on the device already (``core.weights.patch_factors``), so only a resident weight's patch, once a load,
    crosses here. Asked through the backend, the simulated GPU sees (and charges) that crossing as a real one costs.
    """
    target = target_of(at)
    if not same_target(target_of(tensor), target):
        tensor, copy = backend_of(target).copy_to(tensor, target, copy=copy), False
    if not copy and (dtype is None or tensor.dtype == dtype):
        return tensor
    out = torch.empty_like(tensor, dtype=dtype)
    out.copy_(tensor)
    return out


def patch_kind(value: Any) -> str:
    """The kind of a patch value: an adapter name, ``diff``, ``set``, ``model_as_lora`` or ``nested``.

    Raises:
        PatchError: the value is of no kind ComfyUI 0.3.75 applies.
    """
    if isinstance(value, list):
        return "nested"
    name = getattr(value, "name", None)
    if name in ADAPTERS and hasattr(value, "weights"):
        return name
    raw = _raw_kind(value)
    if raw is not None:
        return raw
    shown = name or (value[0] if isinstance(value, tuple) and value else type(value).__name__)
    raise PatchError(
        f"unknown patch type {shown!r}; Device Control applies {', '.join(ADAPTERS + RAW_TYPES)}. The LoRA or "
        "model patch was made by a node or format this ComfyUI does not support: update that node pack."
    )


def _raw_kind(value: Any) -> str | None:
    """``diff`` for a 1-tuple, the named type of a ``(type, data)`` tuple, else ``None``."""
    if not isinstance(value, tuple):
        return None
    if len(value) == 1:
        return "diff"
    return value[0] if len(value) == 2 and value[0] in RAW_TYPES else None


def calculate_weight(
    patches: Sequence[Patch],
    weight: torch.Tensor,
    key: str,
    intermediate_dtype: torch.dtype = torch.float32,
    original_weights: dict | None = None,
) -> torch.Tensor:
    """Apply ``patches`` to ``weight`` (modified in place, and returned).

    Args:
        patches: ComfyUI patch tuples, applied in order.
        weight: the weight to patch, usually a float32 copy.
        key: the weight's name (for messages and ``model_as_lora``).
        intermediate_dtype: dtype the patch tensors are brought to before the math.
        original_weights: base weights for ``model_as_lora`` patches, by key.

    Raises:
        PatchError: a patch of an unknown type.
    """
    for strength, value, strength_model, offset, function in patches:
        whole = None
        if offset is not None:
            whole, weight = weight, weight.narrow(offset[0], offset[1], offset[2])
        if strength_model != 1.0:
            weight *= strength_model
        patch = _Patch(key, strength, value, function or _identity, intermediate_dtype, original_weights)
        weight = patch.apply(weight)
        if whole is not None:
            weight = whole
    return weight


@dataclass(frozen=True)
class _Patch:
    """One patch of a weight, in the terms of ComfyUI's patch tuple."""

    key: str
    strength: float
    value: Any
    function: Callable[[torch.Tensor], torch.Tensor]
    intermediate_dtype: torch.dtype
    original_weights: dict | None

    def apply(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` with this patch applied (in place where the math allows)."""
        kind, value = patch_kind(self.value), self.value
        if kind == "nested":
            base, convert = value[0]
            start = convert(_cast(base, weight, self.intermediate_dtype, copy=True), inplace=True)
            value, kind = (calculate_weight(value[1:], start, self.key, self.intermediate_dtype),), "diff"
        if kind in ADAPTERS:
            return self._adapter(kind, value, weight)
        if kind == "diff":
            return _diff(value, weight, self.key, self.strength, self.function)
        if kind == "set":
            return weight.copy_(value[1][0])
        target, base = value[1][0], self.original_weights[self.key][0][0]
        dtype = self.intermediate_dtype
        delta = _cast(target, weight, dtype) - _cast(base, weight, dtype)
        weight += self.function(self.strength * _cast(delta, weight, weight.dtype))
        return weight

    def _adapter(self, kind: str, value: Any, weight: torch.Tensor) -> torch.Tensor:
        try:
            return _ADAPTER_MATH[kind](value.weights, weight, self.strength, self.function, self.intermediate_dtype)
        except Exception as exc:  # a patch that does not fit its weight: skip it, as ComfyUI does
            log.warning("[Device Control] %s patch for %s not applied: %s", kind, self.key, exc)
            return weight


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _diff(value: tuple, weight: torch.Tensor, key: str, strength: float, function: Callable) -> torch.Tensor:
    payload = value if len(value) == 1 else value[1]
    diff = payload[0]
    if len(payload) > 1 and payload[1]["pad_weight"] and diff.shape != weight.shape:
        weight = _pad_to(weight, list(diff.shape))  # a merge that grows the weight (e.g. a larger vocabulary)
    if strength == 0.0:
        return weight
    if diff.shape != weight.shape:
        log.warning(
            "[Device Control] diff patch for %s not applied: shape %s does not match the weight's %s",
            key,
            list(diff.shape),
            list(weight.shape),
        )
        return weight
    weight += function(strength * _cast(diff, weight, weight.dtype))
    return weight


def _add_scaled(
    weight: torch.Tensor,
    diff: torch.Tensor,
    strength: float,
    alpha: float,
    function: Callable,
    dora_scale: torch.Tensor | None,
    intermediate: torch.dtype,
) -> torch.Tensor:
    """Add ``strength * alpha * diff`` to the weight, or decompose it with DoRA when a scale is given."""
    if dora_scale is not None:
        return _dora(dora_scale, weight, diff, alpha, strength, intermediate, function)
    weight += function(((strength * alpha) * diff).type(weight.dtype))
    return weight


def _dora(
    dora_scale: torch.Tensor,
    weight: torch.Tensor,
    diff: torch.Tensor,
    alpha: float,
    strength: float,
    intermediate: torch.dtype,
    function: Callable,
) -> torch.Tensor:
    """Weight decomposition (DoRA): keep the direction of weight + diff, rescale its norm by ``dora_scale``."""
    scale = _cast(dora_scale, weight, intermediate)
    diff *= alpha
    combined = weight + function(diff).type(weight.dtype)
    if scale.shape[0] == combined.shape[0]:
        norm = weight.reshape(weight.shape[0], -1).norm(dim=1, keepdim=True)
        norm = norm.reshape(weight.shape[0], *[1] * (weight.dim() - 1))
    else:
        norm = combined.transpose(0, 1).reshape(combined.shape[1], -1).norm(dim=1, keepdim=True)
        norm = norm.reshape(combined.shape[1], *[1] * (combined.dim() - 1)).transpose(0, 1)
    norm = norm + torch.finfo(weight.dtype).eps
    combined *= (scale / norm).type(weight.dtype)
    if strength != 1.0:
        combined -= weight
        weight += strength * combined
    else:
        weight[:] = combined
    return weight


def _pad_to(tensor: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """``tensor`` in the top-left corner of a zero tensor of ``shape`` (which must be at least as large)."""
    if len(shape) != tensor.dim() or any(new < old for new, old in zip(shape, tensor.shape, strict=True)):
        raise ValueError(f"cannot pad a {list(tensor.shape)} weight to {list(shape)}")
    out = torch.zeros(shape, dtype=tensor.dtype, device=tensor.device)
    region = tuple(slice(0, size) for size in tensor.shape)
    out[region] = tensor
    return out


def _lora(w: tuple, weight: torch.Tensor, strength: float, function: Callable, dt: torch.dtype) -> torch.Tensor:
    up, down, alpha, mid, dora_scale, reshape = w
    up, down = _cast(up, weight, dt), _cast(down, weight, dt)
    if reshape is not None:
        weight = _pad_to(weight, reshape)
    scale = alpha / down.shape[0] if alpha is not None else 1.0
    if mid is not None:  # LoCon with a mid (Tucker) factor: fold it into the down projection
        mid = _cast(mid, weight, dt)
        shape = [down.shape[1], down.shape[0], mid.shape[2], mid.shape[3]]
        down = torch.mm(down.transpose(0, 1).flatten(start_dim=1), mid.transpose(0, 1).flatten(start_dim=1))
        down = down.reshape(shape).transpose(0, 1)
    diff = torch.mm(up.flatten(start_dim=1), down.flatten(start_dim=1)).reshape(weight.shape)
    return _add_scaled(weight, diff, strength, scale, function, dora_scale, dt)


def _tucker(t: torch.Tensor, b: torch.Tensor, a: torch.Tensor, at: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    return torch.einsum("i j k l, j r, i p -> p r k l", _cast(t, at, dt), _cast(b, at, dt), _cast(a, at, dt))


def _loha(w: tuple, weight: torch.Tensor, strength: float, function: Callable, dt: torch.dtype) -> torch.Tensor:
    w1a, w1b, alpha, w2a, w2b, t1, t2, dora_scale = w
    scale = alpha / w1b.shape[0] if alpha is not None else 1.0
    if t1 is not None:  # CP decomposition
        m1, m2 = _tucker(t1, w1b, w1a, weight, dt), _tucker(t2, w2b, w2a, weight, dt)
    else:
        m1 = torch.mm(_cast(w1a, weight, dt), _cast(w1b, weight, dt))
        m2 = torch.mm(_cast(w2a, weight, dt), _cast(w2b, weight, dt))
    return _add_scaled(weight, (m1 * m2).reshape(weight.shape), strength, scale, function, dora_scale, dt)


def _lokr(w: tuple, weight: torch.Tensor, strength: float, function: Callable, dt: torch.dtype) -> torch.Tensor:
    w1, w2, alpha, w1a, w1b, w2a, w2b, t2, dora_scale = w
    rank = None
    if w1 is None:
        rank = w1b.shape[0]
        w1 = torch.mm(_cast(w1a, weight, dt), _cast(w1b, weight, dt))
    else:
        w1 = _cast(w1, weight, dt)
    if w2 is None:
        rank = w2b.shape[0]
        w2 = (
            torch.mm(_cast(w2a, weight, dt), _cast(w2b, weight, dt))
            if t2 is None
            else _tucker(t2, w2b, w2a, weight, dt)
        )
    else:
        w2 = _cast(w2, weight, dt)
    if len(w2.shape) == 4:
        w1 = w1.unsqueeze(2).unsqueeze(2)
    scale = alpha / rank if alpha is not None and rank is not None else 1.0
    return _add_scaled(weight, torch.kron(w1, w2).reshape(weight.shape), strength, scale, function, dora_scale, dt)


def _glora(w: tuple, weight: torch.Tensor, strength: float, function: Callable, dt: torch.dtype) -> torch.Tensor:
    a1, a2, b1, b2, alpha, dora_scale = w
    old_layout = b2.shape[1] == b1.shape[0] == a1.shape[0] == a2.shape[1]
    rank = a1.shape[0] if old_layout else None
    new_layout = b2.shape[0] == b1.shape[1] == a1.shape[1] == a2.shape[0]
    square = a2.shape[0] == weight.shape[0] and weight.shape[0] == weight.shape[1]
    if new_layout and not (old_layout and square):  # both layouts fit a square weight: the old one wins there
        old_layout, rank = False, a2.shape[0]
    fa1, fa2 = _cast(a1.flatten(start_dim=1), weight, dt), _cast(a2.flatten(start_dim=1), weight, dt)
    fb1, fb2 = _cast(b1.flatten(start_dim=1), weight, dt), _cast(b2.flatten(start_dim=1), weight, dt)
    scale = alpha / rank if alpha is not None else 1.0
    if old_layout:  # the older LyCORIS GLoRA layout
        diff = torch.mm(fb2, fb1) + torch.mm(torch.mm(weight.flatten(start_dim=1).to(dtype=dt), fa2), fa1)
        diff = diff.reshape(weight.shape)
    else:
        if weight.dim() > 2:
            inner = torch.einsum("o i ..., i j -> o j ...", weight.to(dtype=dt), fa1)
            diff = torch.einsum("o i ..., i j -> o j ...", inner, fa2).reshape(weight.shape)
        else:
            diff = torch.mm(torch.mm(weight.to(dtype=dt), fa1), fa2).reshape(weight.shape)
        diff += torch.mm(fb1, fb2).reshape(weight.shape)
    return _add_scaled(weight, diff, strength, scale, function, dora_scale, dt)


def _cayley(blocks: torch.Tensor, alpha: float, size: int, dims: tuple[int, int]) -> torch.Tensor:
    """The orthogonal rotation (Cayley transform) an OFT block describes, its norm bounded by ``alpha``."""
    eye = torch.eye(size, device=blocks.device, dtype=blocks.dtype)
    skew = blocks - blocks.transpose(*dims)
    bounded = skew
    if alpha > 0:
        norm = torch.norm(skew) + 1e-8
        if norm > alpha:
            bounded = skew * alpha / norm
    return (eye + bounded) @ (eye - bounded).float().inverse()


def _oft(w: tuple, weight: torch.Tensor, strength: float, function: Callable, dt: torch.dtype) -> torch.Tensor:
    blocks, _rescale, alpha, dora_scale = w
    alpha = alpha or 0
    blocks = _cast(blocks, weight, dt)
    count, size = blocks.shape[:2]
    rotation = _cayley(blocks, alpha, size, (1, 2)).to(weight)
    eye = torch.eye(size, device=blocks.device, dtype=blocks.dtype)
    rest = weight.shape[1:]
    diff = torch.einsum(
        "k n m, k n ... -> k m ...", (rotation * strength) - strength * eye, weight.view(count, size, *rest)
    ).view(-1, *rest)
    if dora_scale is not None:
        return _dora(dora_scale, weight, diff, alpha, strength, dt, function)
    weight += function((strength * diff).type(weight.dtype))
    return weight


def _boft(w: tuple, weight: torch.Tensor, strength: float, function: Callable, dt: torch.dtype) -> torch.Tensor:
    blocks, rescale, alpha, dora_scale = w
    blocks = _cast(blocks, weight, dt)
    rescale = _cast(rescale, weight, dt) if rescale is not None else None
    stages, _, size = blocks.shape[:3]
    rotation = _cayley(blocks, alpha, size, (-1, -2)).to(weight)
    eye = torch.eye(size, device=blocks.device, dtype=blocks.dtype)
    rotated = original = weight
    half = size // 2
    for stage in range(stages):  # butterfly: each stage rotates pairs of blocks further apart
        block = rotation[stage]
        span = 2**stage * half
        if strength != 1:
            block = block * strength + (1 - strength) * eye
        rotated = rotated.unflatten(0, (-1, 2, span)).transpose(1, 2).flatten(0, 2).unflatten(0, (-1, size))
        rotated = torch.einsum("b i j, b j ...-> b i ...", block, rotated)
        rotated = rotated.flatten(0, 1).unflatten(0, (-1, span, 2)).transpose(1, 2).flatten(0, 2)
    if rescale is not None:
        rotated = rotated * rescale
    diff = _cast(rotated - original, weight, dt)
    if dora_scale is not None:
        return _dora(dora_scale, weight, diff, alpha, strength, dt, function)
    weight += function((strength * diff).type(weight.dtype))
    return weight


_ADAPTER_MATH: dict[str, Callable[..., torch.Tensor]] = {
    "lora": _lora,
    "loha": _loha,
    "lokr": _lokr,
    "glora": _glora,
    "oft": _oft,
    "boft": _boft,
}
