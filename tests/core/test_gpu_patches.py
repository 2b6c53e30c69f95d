"""LoRA factors and GGUF decodes on a CUDA GPU. Each test skips without one and says what it would prove.

The simulated GPU books both (one factor block a load, a decode's temporaries in the caching allocator's blocks:
``tests/core/test_patch_factors.py``, ``tests/core/test_ggml_blocks.py``); these check the same on a real device.
"""

from __future__ import annotations

import gc

import pytest
import torch

from core.detection.ggml_types import GGML_TYPES
from core.devices.pinned import pinned_memory
from core.placement.engine import partial_model_of
from core.weights import ggml_blocks, patch_factors
from core.weights.patch_math import calculate_weight
from tests.core.order_net import LAYERS, Net
from tests.core.small_net import width
from tests.core.test_ggml_blocks import _random_blocks
from tests.core.test_patch_factors import OnTheFly, _lora

CUDA = torch.device("cuda", 0)


@pytest.mark.gpu(proves="a load's LoRA factors cross in one page-locked block, patch as on the host, and are freed")
def test_a_loads_lora_factors_cross_in_one_block_on_a_real_gpu(monkeypatch):
    net = Net()
    patches = {f"layers.{i}.weight": [_lora(width(), width(), i)] for i in range(LAYERS)}
    x = torch.randn(2, width(), generator=torch.Generator().manual_seed(1))
    expected = x
    for i, layer in enumerate(net.layers):
        weight = calculate_weight(patches[f"layers.{i}.weight"], layer.weight.detach().clone(), f"layers.{i}.weight")
        expected = torch.nn.functional.linear(expected, weight, layer.bias.detach())
    calls, place_many = [], patch_factors.place_many
    monkeypatch.setattr(
        patch_factors, "place_many", lambda req, target: calls.append(len(req)) or place_many(req, target)
    )
    pinned = pinned_memory()
    gc.collect()
    before = pinned.pinned_bytes
    engine = partial_model_of(net)
    engine.load(CUDA, 0, hooks=OnTheFly(patches))
    with torch.no_grad():
        first, second = net(x.to(CUDA)), net(x.to(CUDA))
    torch.cuda.synchronize(CUDA)
    assert calls == [LAYERS]  # every layer's factors in one placement, the first pass only
    assert pinned.pinned_bytes > before  # the slabs' and the factors' block, page-locked
    assert torch.equal(first, second)
    torch.testing.assert_close(first.cpu(), expected, rtol=1e-4, atol=1e-4)  # kernel order on the GPU
    engine.unload_all()
    del first, second, net, engine
    gc.collect()
    assert pinned.pinned_bytes == before  # given back with the model


@pytest.mark.gpu(proves="GGUF blocks decode on CUDA bit for bit as on the host, within the room decode_bytes keeps")
@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_gguf_blocks_decode_on_a_real_gpu_as_on_the_host_within_their_room(name, dtype):
    kind = GGML_TYPES[name]
    blocks = 3 * 1024**2 // (4 * kind.values) + 7  # a result and temporaries of more than 1 MiB
    raw = torch.from_numpy(_random_blocks(name, 1, blocks, seed=7).copy()).reshape(-1)
    count = blocks * kind.values
    host = ggml_blocks.dequantize(raw, kind, (count,), dtype)
    on = raw.to(CUDA)
    torch.cuda.synchronize(CUDA)
    base = torch.cuda.memory_allocated(CUDA)
    torch.cuda.reset_peak_memory_stats(CUDA)
    values = ggml_blocks.dequantize(on, kind, (count,), dtype)
    torch.cuda.synchronize(CUDA)
    held = torch.cuda.max_memory_allocated(CUDA) - base  # the caching allocator's blocks, rounding included
    assert torch.equal(values.cpu(), host)
    assert held <= ggml_blocks.decode_bytes(kind, count, dtype), (held, ggml_blocks.decode_bytes(kind, count, dtype))
