"""GGML's quantised blocks (the tensors of a GGUF file) turned back into floats, in torch, on any device.

A GGUF tensor of a quantised type is a run of fixed-size blocks, each holding ``values`` numbers in ``size``
bytes: small integers and one or two fp16 scales (``Q4_0``..``Q8_0``: 32 values a block), or, for the K types
(``Q2_K``..``Q6_K``), 256 values in sub-blocks whose own scales are packed into 4 to 8 bits. This module reads
those blocks with torch's integer and float ops only, so it runs where the weight is: a streamed layer copies
its quantised bytes to the GPU (fewer bytes over the link than fp16) and dequantises there, inside the cast.

**Exactness.** Every value is computed in float32 in the same order of operations as the GGML project's own
reference reader (``gguf.quants`` on PyPI): one rounding per multiply and per add, never a fused multiply-add,
so our float32 result is bit for bit theirs; the oracle test in ``tests/core/test_ggml_blocks.py`` holds that
for every type on random blocks. A caller that wants fp16 or bf16 gets that float32 result rounded once.

**Memory.** A weight is dequantised each time its layer computes, so each decoder makes one float32 tensor and
scales and offsets it in place (``mul_``, ``sub_``, ``add_``: the same roundings as a new tensor per step), instead
of a new float32 tensor per operation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ..errors import ModelFileError

#: Values in each block of the K types.
QK_K = 256


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 fields (``(n, 2)`` bytes) as float32, shaped ``(n, 1)``."""
    return raw.contiguous().view(torch.float16).to(torch.float32)


def _bits(raw: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """Each byte of ``raw`` (``(n, b)``) split into ``count`` fields of ``width`` bits, low bits first:
    ``(n, count, b)``, the field at shift ``k * width`` in row ``k``."""
    shifts = torch.arange(0, count * width, width, dtype=torch.uint8, device=raw.device).view(1, count, 1)
    mask = (1 << width) - 1
    return torch.bitwise_right_shift(raw.unsqueeze(1), shifts) & mask


def _nibbles(raw: torch.Tensor) -> torch.Tensor:
    """``(n, b)`` bytes as ``(n, 2 * b)`` 4-bit values: every low nibble, then every high one."""
    return _bits(raw, 2, 4).reshape(raw.shape[0], -1)


def _high_bits(raw: torch.Tensor) -> torch.Tensor:
    """``(n, b)`` bytes as their ``8 * b`` bits, bit ``i`` of a little-endian integer at index ``i``."""
    return _bits(raw, 8, 1).transpose(1, 2).reshape(raw.shape[0], -1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[:, 2:]).to(torch.float32).sub_(8).mul_(_f16(b[:, :2]))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[:, 4:]).to(torch.float32).mul_(_f16(b[:, :2])).add_(_f16(b[:, 2:4]))


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << 4)).to(torch.float32)
    return q.sub_(16).mul_(_f16(b[:, :2]))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4)).to(torch.float32)
    return q.mul_(_f16(b[:, :2])).add_(_f16(b[:, 2:4]))


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].view(torch.int8).to(torch.float32).mul_(_f16(b[:, :2]))


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, qs, d, dmin = b[:, :16], b[:, 16:80], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0xF).to(torch.float32)).view(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).view(n, 16, 1)
    q = _bits(qs.reshape(n * 2, 32), 4, 2).reshape(n, 16, 16).to(torch.float32)
    return q.mul_(dl).sub_(ml).reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, packed, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    low = _bits(packed[:, :8], 2, 4).reshape(n, 16)
    high = _bits(packed[:, 8:], 4, 2).reshape(n, 16)
    scales = ((low | (high << 4)).to(torch.int8) - 32).to(torch.float32)
    dl = (d * scales).view(n, 16, 1)
    ql = _bits(qs.reshape(n * 2, 32), 4, 2).reshape(n, 16, 16)
    qh = _bits(hmask, 8, 1).reshape(n, 16, 16) ^ 1  # the offset of 4 applies where the mask bit is 0
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).to(torch.float32)
    return q.mul_(dl).reshape(n, QK_K)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and eight 6-bit minimums packed into 12 bytes (Q4_K and Q5_K), as float32."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scale = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    low = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return scale.to(torch.float32), low.to(torch.float32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scale, low = _k_scales(b[:, 4:16])
    d = (_f16(b[:, :2]) * scale).view(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * low).view(n, 8, 1)
    q = _bits(b[:, 16:].reshape(n * 4, 32), 2, 4).reshape(n, 8, 32).to(torch.float32)
    return q.mul_(d).sub_(dm).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scale, low = _k_scales(b[:, 4:16])
    d = (_f16(b[:, :2]) * scale).view(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * low).view(n, 8, 1)
    ql = _bits(b[:, 48:].reshape(n * 4, 32), 2, 4).reshape(n, 8, 32)
    qh = _bits(b[:, 16:48], 8, 1).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.float32)
    return q.mul_(d).sub_(dm).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    dl = (d * scales.contiguous().view(torch.int8).to(torch.float32)).view(n, 16, 1)
    low = _bits(ql.reshape(n * 2, 64), 2, 4).reshape(n, 8, 32)
    high = _bits(qh.reshape(n * 2, 32), 4, 2).reshape(n, 8, 32)
    q = (low | (high << 4)).to(torch.float32).sub_(32).reshape(n, 16, 16)
    return q.mul_(dl).reshape(n, QK_K)


def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


def _f16_values(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).to(torch.float32)


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).to(torch.float32)


class BlockLayout(Protocol):
    """What :func:`dequantize` needs of a GGML type (``core.detection.ggml_types.GgmlType`` is one)."""

    name: str
    values: int
    size: int

    def nbytes(self, count: int) -> int: ...


#: The decoder of each GGML type we read, by its name: ``(n, size)`` bytes in, ``(n, values)`` float32 out.
DECODERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "F32": _f32,
    "F16": _f16_values,
    "BF16": _bf16,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def check_bytes(raw: torch.Tensor, kind: BlockLayout, shape: Sequence[int]) -> int:
    """The number of values ``shape`` holds, once ``raw`` is known to be the ``uint8`` bytes of that many in
    ``kind``'s blocks.

    Raises:
        ModelFileError: ``raw`` is not the number of bytes ``shape`` takes in ``kind`` (a truncated tensor), or the
            innermost dimension is not a whole number of blocks.
    """
    count = 1
    for dim in shape:
        count *= int(dim)
    if shape and int(shape[-1]) % kind.values:
        raise ModelFileError(
            f"a {kind.name} tensor of shape {tuple(shape)} does not split into blocks of {kind.values} values; "
            "the file is damaged or not a GGUF model: download it again."
        )
    if raw.dtype != torch.uint8 or raw.numel() != kind.nbytes(count):
        raise ModelFileError(
            f"a {kind.name} tensor of shape {tuple(shape)} needs {kind.nbytes(count)} bytes, and {raw.numel()} "
            "were given: the file is truncated or damaged; download it again."
        )
    return count


def dequantize(
    raw: torch.Tensor, kind: BlockLayout, shape: Sequence[int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The float tensor of ``shape`` that the bytes ``raw`` (a ``uint8`` tensor, on any device) hold in ``kind``'s
    blocks, computed in float32 on ``raw``'s device and returned as ``dtype``.

    Raises:
        ModelFileError: as :func:`check_bytes`.
    """
    count = check_bytes(raw, kind, shape)
    values = DECODERS[kind.name](raw.reshape(-1, kind.size)) if count else raw.new_empty(0, dtype=torch.float32)
    return values.reshape(tuple(shape)).to(dtype)
