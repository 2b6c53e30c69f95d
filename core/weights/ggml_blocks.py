"""GGML's quantised blocks (the tensors of a GGUF file) turned back into floats, in torch, on any device.

A GGUF tensor of a quantised type is a run of fixed-size blocks, each holding ``values`` numbers in ``size``
bytes: small integers and one or two fp16 scales (``Q4_0``..``Q8_0``: 32 values a block), or, for the K types
(``Q2_K``..``Q6_K``), 256 values in sub-blocks whose own scales are packed into 4 to 8 bits. This module reads
those blocks with torch's integer and float ops only, so it runs where the weight is: a streamed layer copies
its quantised bytes to the GPU (fewer bytes over the link than fp16) and dequantises there, inside the cast.

**Exactness.** Every value is computed in float32 in the same order of operations as the GGML project's own
reference reader (``gguf.quants`` on PyPI): one rounding per multiply and per add, never a fused multiply-add,
so our float32 result is bit for bit theirs; the oracle test in ``tests/core/test_ggml_blocks.py`` holds that
for every type on random blocks. A caller that wants fp16 or bf16 gets that float32 result rounded once (bit for
bit, however it is computed).

**Memory.** A weight is dequantised on the device each time its layer computes, inside the placement budget's
streaming reserve, so a decode holds little besides its result: each decoder makes one tensor and scales and
offsets it in place (``mul_``, ``sub_``, ``add_``: the same roundings as a new tensor per step); ``Q4_0``,
``Q5_0`` and ``Q8_0`` decode straight into fp16 (exactly, see :data:`EXACT_IN_FP16`); any other decode into a
dtype narrower than float32 goes a chunk of blocks at a time, so no float32 copy of a whole weight is made (four
bytes a value: 144 MiB for a 3072x12288 weight whose Q4_0 blocks take 20 MiB). :func:`decode_bytes` is what a
decode holds at most, the room the plan keeps for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol

import torch

from ..devices.allocator import BLOCK_UNIT, LARGE_SLACK, SMALL_BLOCK, block_bytes
from ..errors import ModelFileError

#: Values in each block of the K types.
QK_K = 256

#: A weight of more values than this is decoded this many at a time (16 MiB of float32), into its result: the
#: decoding's temporaries stay those of one chunk however large the weight.
CHUNK_VALUES = 1 << 22

#: The types whose value is a small integer times one fp16 scale (``(q - offset) * d``): the integer and the scale
#: are exact in fp16 and fp16's multiply rounds their exact product once, as float32's exact product rounded to
#: fp16 does, so these decode straight into fp16, bit for bit. Not into bf16 (the fp16 scale does not fit its 8
#: bits of precision), nor the types that add a second scale (two roundings in fp16, one in float32).
EXACT_IN_FP16 = frozenset({"Q4_0", "Q5_0", "Q8_0"})


def _f16(raw: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Little-endian fp16 fields (``(n, 2)`` bytes) as ``dtype``, shaped ``(n, 1)``."""
    return raw.contiguous().view(torch.float16).to(dtype)


def _bits(raw: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """Each byte of ``raw`` (``(n, b)``) split into ``count`` fields of ``width`` bits, low bits first:
    ``(n, count, b)``, the field at shift ``k * width`` in row ``k``."""
    shifts = torch.arange(0, count * width, width, dtype=torch.uint8, device=raw.device).view(1, count, 1)
    return torch.bitwise_right_shift(raw.unsqueeze(1), shifts).bitwise_and_((1 << width) - 1)


def _nibbles(raw: torch.Tensor) -> torch.Tensor:
    """``(n, b)`` bytes as ``(n, 2 * b)`` 4-bit values: every low nibble, then every high one."""
    return _bits(raw, 2, 4).reshape(raw.shape[0], -1)


def _high_bits(raw: torch.Tensor) -> torch.Tensor:
    """``(n, b)`` bytes as their ``8 * b`` bits, bit ``i`` of a little-endian integer at index ``i``."""
    return _bits(raw, 8, 1).transpose(1, 2).reshape(raw.shape[0], -1)


def _q4_0(b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return _nibbles(b[:, 2:]).to(dtype).sub_(8).mul_(_f16(b[:, :2], dtype))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[:, 4:]).to(torch.float32).mul_(_f16(b[:, :2])).add_(_f16(b[:, 2:4]))


def _q5_0(b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    q = _nibbles(b[:, 6:]).bitwise_or_(_high_bits(b[:, 2:6]).bitwise_left_shift_(4)).to(dtype)
    return q.sub_(16).mul_(_f16(b[:, :2], dtype))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4)).to(torch.float32)
    return q.mul_(_f16(b[:, :2])).add_(_f16(b[:, 2:4]))


def _q8_0(b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return b[:, 2:].view(torch.int8).to(dtype).mul_(_f16(b[:, :2], dtype))


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


#: The most temporaries a decode holds at once besides its result and the chunk's float32 values: the chunk's
#: integer fields, scales and offsets (each rounded up to a caching allocator's block, :func:`decode_bytes`).
DECODE_TEMPORARIES = 6

#: Bytes a block of each type takes in its decoder's temporaries besides its result, at their most (its integer
#: fields and its scales), as the simulated GPU's books measure them (``tests/core/test_ggml_blocks.py``).
SCRATCH: dict[str, int] = {
    "F32": 0,
    "F16": 0,
    "BF16": 0,
    "Q4_0": 32,
    "Q4_1": 32,
    "Q5_0": 32,
    "Q5_1": 32,
    "Q8_0": 6,
    "Q2_K": 392,
    "Q3_K": 932,
    "Q4_K": 384,
    "Q5_K": 896,
    "Q6_K": 836,
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


def _decoder(name: str, dtype: torch.dtype) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.dtype]:
    """The decoder of type ``name`` for a result in ``dtype``, and the dtype it computes in: ``dtype`` itself for
    float32 and for the :data:`EXACT_IN_FP16` types into fp16, float32 otherwise."""
    if dtype == torch.float16 and name in EXACT_IN_FP16:
        return partial(DECODERS[name], dtype=dtype), dtype
    return DECODERS[name], torch.float32


def dequantize(
    raw: torch.Tensor, kind: BlockLayout, shape: Sequence[int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The float tensor of ``shape`` that the bytes ``raw`` (a ``uint8`` tensor, on any device) hold in ``kind``'s
    blocks, in ``dtype``, computed on ``raw``'s device: bit for bit the float32 result rounded once to ``dtype``.

    Decoded straight into ``dtype`` where that is exact (float32; fp16 for :data:`EXACT_IN_FP16`); otherwise in
    float32 a chunk of at most :data:`CHUNK_VALUES` values at a time, each chunk rounded into the result, so no
    float32 copy of a whole large weight is ever made (:func:`decode_bytes` says what is held at most).

    Raises:
        ModelFileError: as :func:`check_bytes`.
    """
    count = check_bytes(raw, kind, shape)
    decode, work = _decoder(kind.name, dtype)
    blocks = raw.reshape(-1, kind.size)
    step = blocks.shape[0] if work == dtype else _chunk_blocks(kind)
    if blocks.shape[0] <= step:
        values = decode(blocks) if count else raw.new_empty(0, dtype=work)
        return values.reshape(tuple(shape)).to(dtype)
    out = raw.new_empty((blocks.shape[0], kind.values), dtype=dtype)
    for start in range(0, blocks.shape[0], step):
        out[start : start + step].copy_(decode(blocks[start : start + step]))
    return out.reshape(tuple(shape))


def decode_bytes(kind: BlockLayout, count: int, dtype: torch.dtype) -> int:
    """The most device bytes :func:`dequantize` holds at once, besides its input, for ``count`` values of ``kind``
    into ``dtype``: its result and its temporaries, each in the block a caching allocator gives it
    (``core.devices.allocator``: up to a 512-byte unit more than its bytes, and up to 1 MiB more above 1 MiB). An
    upper bound, held against the simulated GPU's books in ``tests/core/test_ggml_blocks.py``; the placement plan keeps
    this room for a streamed quantised weight."""
    if count <= 0:
        return 0
    _decode, work = _decoder(kind.name, dtype)
    blocks = -(-count // kind.values)
    result = block_bytes(blocks * kind.values * dtype.itemsize)
    if work == dtype:  # decoded whole, in place in its result
        return result + _in_blocks(blocks * SCRATCH[kind.name])
    chunk = min(blocks, _chunk_blocks(kind))  # a chunk at a time: its float32 values and fields beside the result
    return result + block_bytes(chunk * kind.values * work.itemsize) + _in_blocks(chunk * SCRATCH[kind.name])


def _in_blocks(nbytes: int) -> int:
    """The most :data:`DECODE_TEMPORARIES` tensors of ``nbytes`` together take in a caching allocator's blocks
    (``core.devices.allocator.block_bytes``): each up to a 512-byte unit more, and each of more than 1 MiB (at most
    ``nbytes // 1 MiB`` of them) up to 1 MiB more. Counted by size, so a small model's decode keeps kilobytes of room
    for it, not megabytes."""
    large = min(DECODE_TEMPORARIES, max(0, nbytes - 1) // SMALL_BLOCK)
    return nbytes + large * LARGE_SLACK + DECODE_TEMPORARIES * BLOCK_UNIT


def _chunk_blocks(kind: BlockLayout) -> int:
    """Blocks of ``kind`` in one chunk of :func:`dequantize`."""
    return max(1, CHUNK_VALUES // kind.values)
