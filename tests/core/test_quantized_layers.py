"""Quantised (GGUF) weights in our cast layers (``core.weights.quantized``): a layer holding GGML blocks computes
what the same layer holding the dequantised weight computes, bit for bit, resident, streamed whole, streamed in
row slices and through its model's ring on a simulated GPU; the device holds the quantised bytes (budgets and
books count them, not the floats); a LoRA applies to the dequantised weight. The weights are quantised by the
GGML project's own ``gguf.quants`` (the plain 32-value types) or are random blocks (the K types, which ``gguf``
does not quantise), and the expected weight is ``gguf.quants.dequantize``'s. A streamed quantised layer's decode
stays inside the plan's streaming reserve."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from core.detection.ggml_types import GGML_TYPES
from core.devices.reported import ShapedParameter
from core.devices.sim.device import SimulatedDevice
from core.devices.sim.tensor import SimTensor
from core.devices.slices import RowSlices, ready_bytes
from core.errors import ModelFileError
from core.placement.engine import partial_model_of
from core.placement.plan import Layer, layers_of, plan_layers, stream_reserve
from core.placement.rings import settle
from core.placement.slabs import layer_bytes
from core.placement.streaming import NO_HOOKS, reset_flags, stream
from core.weights import ops
from core.weights.patch_math import calculate_weight
from core.weights.patching import OnTheFlyPatch
from core.weights.quantized import is_quantized, layout_of, quantize_parameter, weight_shape
from tests.core.test_ggml_blocks import _random_blocks

MiB = 1024**2
PLAIN = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
K_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def _blocks(kind: str, rows: int, columns: int, seed: int) -> np.ndarray:
    """``rows`` rows of ``columns`` values in ``kind``'s blocks: quantised from random weights by ``gguf``, or
    random blocks for the K types."""
    if kind in K_TYPES:
        return _random_blocks(kind, rows, columns // GGML_TYPES[kind].values, seed)
    weights = np.random.default_rng(seed).normal(0, 0.5, size=(rows, columns)).astype(np.float32)
    return gguf.quants.quantize(weights, gguf.GGMLQuantizationType[kind])


def _quantise(layer: torch.nn.Module, kind: str, seed: int = 0) -> torch.Tensor:
    """Quantise ``layer``'s weight in place; return the weight it holds now, dequantised by ``gguf`` (the oracle)."""
    shape = tuple(layer.weight.shape)
    rows, columns = shape[0], int(np.prod(shape[1:]))
    data = _blocks(kind, rows, columns, seed)
    expected = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind])
    quantize_parameter(layer, "weight", torch.from_numpy(data.copy()), GGML_TYPES[kind], shape)
    return torch.from_numpy(np.ascontiguousarray(expected, dtype=np.float32)).reshape(shape)


def _plain_twin(layer: ops.Linear, weight: torch.Tensor) -> ops.Linear:
    twin = ops.Linear(layer.in_features, layer.out_features)
    with torch.no_grad():
        twin.weight.copy_(weight)
        twin.bias.copy_(layer.bias)
    twin.comfy_cast_weights = True  # casts to the input's dtype, as the quantised layer does
    return twin


@pytest.mark.parametrize("kind", PLAIN + K_TYPES)
def test_a_quantised_linear_computes_what_its_dequantised_twin_computes(kind):
    torch.manual_seed(1)
    layer = ops.Linear(512, 128)
    expected = _quantise(layer, kind)
    assert layer.weight.dtype == torch.uint8 and is_quantized(layer) and weight_shape(layer) == (128, 512)
    assert layer.weight.numel() == GGML_TYPES[kind].nbytes(128 * 512)  # the file's bytes, one row of blocks a row
    assert layer.weight.shape == (128, 512) and layer.weight.size(0) == 128  # it reports the weight's shape
    twin = _plain_twin(layer, expected)
    x = torch.randn(3, 512)
    with torch.no_grad():
        assert torch.equal(layer(x), twin(x))  # resident on the host: dequantised by the cast, never multiplied raw
        assert torch.equal(layer(x.bfloat16()), twin(x.bfloat16()))  # fp32 result rounded once to the input's dtype


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q6_K"])
def test_streamed_whole_or_in_slices_it_computes_as_resident_and_only_its_blocks_cross(kind):
    torch.manual_seed(2)
    layer = ops.Linear(256, 256)
    twin = _plain_twin(layer, _quantise(layer, kind))
    x = torch.randn(4, 256)
    with torch.no_grad():
        reference = layer(x)
    device = SimulatedDevice(64 * MiB)
    for slices in (None, RowSlices((0, 64, 192, 256))):
        reset_flags(Layer("layer", layer, 0, True))
        stream(Layer("layer", layer, 0, True), device, NO_HOOKS, slices)
        with torch.no_grad():
            out = layer(device.place(x))
        assert isinstance(out, SimTensor) and torch.equal(device.release(out), reference), slices
    with torch.no_grad():
        assert torch.equal(reference, twin(x))
    assert layer.weight.dtype == torch.uint8 and not isinstance(layer.weight, SimTensor)  # stored as it was
    del out
    gc.collect()
    assert device.allocated() == 0


class _Quantised(torch.nn.Module):
    """Thirty-two quantised Linears of one type and a plain norm: a model the engine loads under a budget (with
    room to stream one block decoded: several times its quantised bytes)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.blocks = torch.nn.Sequential(*(ops.Linear(256, 256) for _ in range(32)))
        self.norm = ops.LayerNorm(256)
        self.expected = [_quantise(block, kind, seed) for seed, block in enumerate(self.blocks)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.norm(x)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K"])
def test_under_a_budget_the_device_holds_quantised_bytes_and_the_model_computes_as_on_the_host(kind):
    net = _Quantised(kind)
    x = torch.randn(2, 256)
    with torch.no_grad():
        reference = net(x)
    block_bytes = net.blocks[0].weight.numel() + net.blocks[0].bias.numel() * 4
    carried = layer_bytes(net.blocks[0])  # as a ring slot holds it: each tensor on pages of its own
    assert block_bytes < 256 * 256 * 2  # smaller than the fp16 weight alone
    device = SimulatedDevice(64 * MiB)
    engine = partial_model_of(net)
    assert engine.total_bytes() == 32 * block_bytes + 2 * 256 * 4  # budgets count the quantised bytes
    reserve = stream_reserve(carried, ready_bytes(net.blocks[0], block_bytes))  # one block decoded there too
    budget = 4 * block_bytes + 2 * 256 * 4 + reserve
    report = engine.load(device, budget)
    resident = [block for block in net.blocks if isinstance(block.weight, SimTensor)]
    assert 0 < len(resident) < 32 and report.streamed_bytes > 0
    assert all(block.weight.dtype == torch.uint8 for block in resident)  # moved as blocks, not dequantised
    assert all(block.weight.shape == (256, 256) for block in net.blocks)  # on the device too, as ComfyUI reads it
    assert report.resident_bytes == engine.resident_bytes(device) <= budget - reserve
    with torch.no_grad():
        out = net(device.place(x))
    assert torch.equal(device.release(out), reference)
    assert engine.ring.ring_bytes > 0  # the streamed blocks went through the model's ring (its slab's views)
    del out
    settle(net)
    assert device.allocated() == report.resident_bytes
    engine.unload_all()
    gc.collect()
    assert device.allocated() == 0 and all(b.weight.dtype == torch.uint8 for b in net.blocks)
    assert all(isinstance(b.weight, ShapedParameter) and b.weight.shape == (256, 256) for b in net.blocks)


def test_a_lora_applies_to_the_dequantised_weight():
    torch.manual_seed(4)
    layer = ops.Linear(256, 128)
    weight = _quantise(layer, "Q5_1")
    up, down = torch.randn(128, 8) * 0.1, torch.randn(8, 256) * 0.1
    patches = {"w": [(0.7, SimpleNamespace(name="lora", weights=(up, down, 4.0, None, None, None)), 1.0, None, None)]}
    patched = calculate_weight(patches["w"], weight.clone(), "w")
    twin = _plain_twin(layer, patched)
    device = SimulatedDevice(64 * MiB)
    stream(Layer("layer", layer, 0, True), device, NO_HOOKS, None)
    layer.weight_function = [OnTheFlyPatch("w", patches)]
    x = torch.randn(3, 256)
    with torch.no_grad():
        out = device.release(layer(device.place(x)))
        assert torch.equal(out, twin(x))
    assert layout_of(layer, "weight") is not None and layer.weight.dtype == torch.uint8  # the stored bytes unpatched


def test_bytes_that_do_not_fit_the_shape_are_refused_before_the_layer_changes():
    layer = ops.Linear(256, 64)
    data = torch.from_numpy(_blocks("Q8_0", 64, 256, 0).copy())
    with pytest.raises(ModelFileError, match=r"Q8_0 tensor of shape \(64, 256\) needs 17408 bytes"):
        quantize_parameter(layer, "weight", data.reshape(-1)[:-34], GGML_TYPES["Q8_0"], (64, 256))
    with pytest.raises(ModelFileError, match="blocks of 32 values"):
        quantize_parameter(layer, "weight", data, GGML_TYPES["Q8_0"], (63, 250))
    assert layer.weight.dtype == torch.float32 and not is_quantized(layer)


def test_a_quantised_embedding_looks_up_dequantised_rows():
    """A text encoder's token table is often quantised in GGUF files."""
    table = ops.Embedding(64, 256)
    expected = _quantise(table, "Q4_K")
    tokens = torch.tensor([[0, 5, 63, 5]])
    with torch.no_grad():
        assert torch.equal(table(tokens), expected[tokens])
        assert torch.equal(table(tokens, out_dtype=torch.float16), expected[tokens].half())


def _random_q4_0_linear(rows: int, columns: int) -> ops.Linear:
    """A Linear holding random ``Q4_0`` blocks (finite scales): only the sizes matter here."""
    layer = ops.Linear(columns, rows)
    data = _random_blocks("Q4_0", rows, columns // 32, seed=rows)
    quantize_parameter(layer, "weight", torch.from_numpy(data.copy()), GGML_TYPES["Q4_0"], (rows, columns))
    return layer


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "sliced"])
def test_a_streamed_q4_0_layer_is_dequantised_within_the_plans_streaming_reserve(dtype, sliced):
    """What a streamed quantised layer holds on the device while it computes (its blocks, decoded: result and
    temporaries) is what the plan's reserve keeps room for, in whichever dtype the model computes, whole or one
    row slice at a time. A float32 decode then rounded (four bytes a value, then two) is not."""
    layer = _random_q4_0_linear(2048, 4096)  # 8M values: more than one chunk of the decode (CHUNK_VALUES)
    (entry,) = layers_of(layer)
    plan = plan_layers([entry], 0, unit=entry.nbytes // 4 if sliced else entry.nbytes)  # it streams, nothing fits
    assert plan.streamed_layers == 1 and ("" in plan.slices) == sliced
    device = SimulatedDevice(256 * MiB)
    stream(entry, device, NO_HOOKS, plan.slices.get(""))
    x = device.place(torch.randn(2, 4096, dtype=dtype))
    assert _peak_beside_activations(device, layer, x) <= plan.reserve_bytes
    reset_flags(entry)


def _peak_beside_activations(device: SimulatedDevice, module: torch.nn.Module, x: torch.Tensor) -> int:
    """The most ``module``'s forward on ``x`` holds on ``device`` beyond what was there before, less the activations
    (its output, and one slice's output beside it)."""
    gc.collect()
    base = device.allocated()
    device.reset_peak()
    with torch.no_grad():
        out = module(x)
    return device.peak_allocated() - base - 2 * out.numel() * out.element_size()


class _Q4Stack(torch.nn.Module):
    """Forty-eight Q4_0 Linears run one after another: a model half of which streams through its ring."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*(_random_q4_0_linear(512, 512) for _ in range(48)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize(
    "dtype",
    [torch.float16, torch.bfloat16, torch.float32],
)
def test_quantised_layers_streamed_through_the_ring_stay_within_the_plans_reserve(dtype):
    """The ring's slots and one layer decoded: what the device holds beyond the resident layers while the model
    computes, activations aside (a few KiB here), is within the plan's reserve."""
    net = _Q4Stack()
    engine = partial_model_of(net)
    device = SimulatedDevice(256 * MiB)
    report = engine.load(device, engine.total_bytes() // 2)
    assert report.plan.streamed_layers > 0 and 0 < report.plan.ready_bytes < report.plan.reserve_bytes
    x = device.place(torch.randn(2, 512, dtype=dtype))
    assert _peak_beside_activations(device, net, x) <= report.plan.reserve_bytes
    del x
    settle(net)
    engine.unload_all()
