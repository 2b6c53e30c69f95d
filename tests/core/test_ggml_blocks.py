"""Our GGML block reader (``core.weights.ggml_blocks``) against the GGML project's own (``gguf.quants``, numpy), the
oracle: every type, bit for bit in float32, on blocks ``gguf`` quantised from real values and on random blocks
(every bit pattern a block can hold, its fp16 scales finite), plus the errors a damaged tensor gets; the decode
into fp16 and bf16 against that float32 result rounded once, over every finite fp16 scale; and the device bytes a
decode holds (its result and temporaries) against :func:`decode_bytes`, on the simulated GPU's books."""

from __future__ import annotations

import gc

import gguf
import numpy as np
import pytest
import torch

from core.detection.ggml_types import GGML_TYPES, ggml_type
from core.devices.sim.device import SimulatedDevice
from core.errors import ModelFileError
from core.weights import ggml_blocks
from core.weights.ggml_blocks import DECODERS, EXACT_IN_FP16, SCRATCH, decode_bytes, dequantize
from core.weights.quantized import QuantizedLayout

#: Where each type keeps its fp16 scales (byte ranges in a block): random bytes there could be NaN or infinite.
SCALES = {
    "Q4_0": [(0, 2)],
    "Q4_1": [(0, 2), (2, 4)],
    "Q5_0": [(0, 2)],
    "Q5_1": [(0, 2), (2, 4)],
    "Q8_0": [(0, 2)],
    "Q2_K": [(80, 82), (82, 84)],
    "Q3_K": [(108, 110)],
    "Q4_K": [(0, 2), (2, 4)],
    "Q5_K": [(0, 2), (2, 4)],
    "Q6_K": [(208, 210)],
}
#: The types ``gguf`` can also quantise (it only dequantises the K types).
QUANTISABLE = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16", "F16"]

MiB = 1024**2


def _kind(name: str):
    return GGML_TYPES[name]


def _random_blocks(name: str, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """``rows`` rows of random blocks of type ``name``, with finite fp16 scales."""
    kind = _kind(name)
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, blocks_per_row, kind.size), dtype=np.uint8)
    for start, stop in SCALES.get(name, []):
        scales = rng.normal(0, 0.05, size=(rows, blocks_per_row)).astype(np.float16)
        data[..., start:stop] = scales.view(np.uint8).reshape(rows, blocks_per_row, 2)
    return data.reshape(rows, blocks_per_row * kind.size)


def _ours(data: np.ndarray, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    kind = _kind(name)
    rows = data.shape[0]
    shape = (rows, data.shape[1] // kind.size * kind.values)
    return dequantize(torch.from_numpy(data.copy()).reshape(-1), kind, shape, dtype)


def _same_bits(ours: torch.Tensor, oracle: np.ndarray) -> None:
    expected = torch.from_numpy(np.ascontiguousarray(oracle, dtype=np.float32))
    assert ours.shape == expected.shape
    assert torch.equal(ours.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("name", list(SCALES))
def test_random_blocks_match_the_ggml_reader_bit_for_bit(name):
    data = _random_blocks(name, rows=3, blocks_per_row=4, seed=len(name) * 7 + ord(name[1]))
    oracle = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[name])
    _same_bits(_ours(data, name), oracle)


@pytest.mark.parametrize("name", QUANTISABLE)
def test_blocks_quantised_by_gguf_from_real_weights_match_bit_for_bit(name):
    weights = torch.nn.Linear(512, 6).weight.detach().numpy().astype(np.float32)
    data = gguf.quants.quantize(weights, gguf.GGMLQuantizationType[name])
    oracle = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[name])
    ours = _ours(data.view(np.uint8), name)  # gguf hands F16 back as float16 values, the rest as bytes
    _same_bits(ours, oracle)
    assert torch.allclose(ours, torch.from_numpy(weights), atol=0.05)  # a quantisation of these weights, not noise


def test_f32_tensors_come_back_as_stored():
    weights = torch.randn(4, 8)
    raw = weights.view(torch.uint8).reshape(-1)
    assert torch.equal(dequantize(raw, _kind("F32"), (4, 8)), weights)


def test_the_result_is_rounded_once_to_the_dtype_asked_for():
    data = _random_blocks("Q4_K", rows=2, blocks_per_row=1, seed=3)
    assert torch.equal(_ours(data, "Q4_K", torch.float16), _ours(data, "Q4_K").to(torch.float16))


def test_a_truncated_tensor_is_refused_naming_the_bytes_it_needs():
    raw = torch.zeros(34 * 2 - 1, dtype=torch.uint8)
    with pytest.raises(ModelFileError, match=r"needs 68 bytes, and 67 were given: the file is truncated"):
        dequantize(raw, _kind("Q8_0"), (2, 32))


def test_a_row_that_is_not_whole_blocks_is_refused():
    with pytest.raises(ModelFileError, match=r"does not split into blocks of 256 values"):
        dequantize(torch.zeros(144, dtype=torch.uint8), _kind("Q4_K"), (1, 255))


def test_an_unknown_type_is_refused_with_the_ones_we_read():
    with pytest.raises(ModelFileError, match=r"GGML type 16, which Device Control does not dequantise \(it reads F32"):
        ggml_type(16, "blk.0.attn_q.weight")
    assert ggml_type(12).name == "Q4_K"


def test_every_type_we_read_has_the_size_ggml_gives_it_and_a_decoder():
    assert set(DECODERS) == set(GGML_TYPES)
    for kind in GGML_TYPES.values():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind.ggml_id)] == (kind.values, kind.size), kind.name
        assert gguf.GGMLQuantizationType(kind.ggml_id).name == kind.name


def _every_fp16_scale(name: str, seed: int) -> torch.Tensor:
    """Blocks of type ``name`` (``Q4_0``, ``Q5_0``, ``Q8_0``: the scale in their first two bytes) whose scales are
    every finite fp16 value, each once, with both signs, subnormals and the largest (65504, where the product
    overflows fp16), beside random integers; the first block's integers are all the extreme one."""
    kind = _kind(name)
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    scales = bits[torch.isfinite(bits.view(torch.float16))]
    data = torch.from_numpy(_random_blocks(name, 1, scales.numel(), seed).copy()).reshape(-1, kind.size)
    data[:, :2] = scales.view(torch.uint8).reshape(-1, 2)
    data[0, 2:] = 0x80 if name == "Q8_0" else 0  # -128, or the low nibbles 0 (q - 8 = -8, q - 16 = -16)
    return data.reshape(-1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(EXACT_IN_FP16))
def test_decoding_straight_into_a_narrow_dtype_is_the_float32_result_rounded_once(name, dtype, monkeypatch):
    """Bit for bit, over every finite fp16 scale, whole, in chunks and in row slices, the result equals the
    GGML reader's float32 values rounded once to the dtype (fp16: computed in fp16; bf16: in float32 chunks)."""
    kind = _kind(name)
    raw = _every_fp16_scale(name, seed=len(name) + dtype.itemsize)
    rows = raw.numel() // kind.size // 4  # four blocks a row
    oracle = gguf.quants.dequantize(raw.numpy().reshape(rows, -1), gguf.GGMLQuantizationType[name])
    expected = torch.from_numpy(np.ascontiguousarray(oracle, dtype=np.float32)).to(dtype)
    layout = QuantizedLayout(kind, (rows, 4 * kind.values))
    blocks = raw.reshape(layout.row_shape())

    def same(ours: torch.Tensor, wanted: torch.Tensor) -> bool:
        return ours.dtype == dtype and torch.equal(ours.view(torch.int16), wanted.view(torch.int16))

    assert same(layout.decode(blocks, dtype), expected)
    monkeypatch.setattr(ggml_blocks, "CHUNK_VALUES", 1000 * kind.values)  # 64 chunks, the last one short
    assert same(layout.decode(blocks, dtype), expected)
    for start, stop in [(0, 7), (7, 8), (1000, rows)]:
        assert same(layout.decode(blocks[start:stop], dtype, (start, stop)), expected[start:stop])
    exact = torch.from_numpy(np.ascontiguousarray(oracle, dtype=np.float32))
    assert (expected.float() != exact).any()  # the rounding is exercised
    if dtype == torch.float16:  # so are fp16's overflow and its subnormals
        assert torch.isinf(expected).any() and (expected != 0).logical_and(expected.abs() < 2**-14).any()
    else:  # and why bf16 is not computed in bf16: the fp16 scale does not fit its precision
        q = DECODERS[name](raw.reshape(-1, kind.size)) / _scales(raw, kind)
        narrow = q.to(dtype) * _scales(raw, kind).to(dtype)
        assert not torch.equal(narrow.reshape(expected.shape).view(torch.int16), expected.view(torch.int16))


def _scales(raw: torch.Tensor, kind) -> torch.Tensor:
    return raw.reshape(-1, kind.size)[:, :2].contiguous().view(torch.float16).to(torch.float32)


@pytest.mark.parametrize("size", ["small", "over 1 MiB"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("name", sorted(SCRATCH))
def test_a_decode_holds_on_the_device_at_most_what_decode_bytes_says(name, dtype, size, monkeypatch):
    """The room the plan keeps for a streamed quantised weight (its result and temporaries), against the
    simulated GPU's books in the blocks a caching allocator gives (``core.devices.allocator``): whole, and in
    chunks (here of 64 blocks, as a weight of more than CHUNK_VALUES); small, and with a result and temporaries of
    more than 1 MiB, which may take up to 1 MiB more each."""
    kind = _kind(name)
    blocks = 300 if size == "small" else 3 * MiB // (4 * kind.values) + 7
    raw = torch.from_numpy(_random_blocks(name, 1, blocks, seed=7).copy()).reshape(-1)
    count = blocks * kind.values
    for chunk in (ggml_blocks.CHUNK_VALUES, 64 * kind.values):
        monkeypatch.setattr(ggml_blocks, "CHUNK_VALUES", chunk)
        device = SimulatedDevice(256 * MiB)
        on = device.place(raw)
        gc.collect()
        base = device.reserved()
        device.reset_peak()
        values = dequantize(on, kind, (count,), dtype)
        held = device.peak_reserved() - base
        assert values.numel() * dtype.itemsize <= held or name in ("F32", "F16", "BF16")  # a view of its input
        assert held <= decode_bytes(kind, count, dtype), chunk
        del values, on
