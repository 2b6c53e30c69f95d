"""The paths only a CUDA GPU takes. Each test skips without one and says what it would prove.

Everything else in these paths (plans, books, patching, casting) is shared with the CPU and simulated-GPU
code the other tests run; what is left here is what only a real device can show. Each starts from the same
state of the GPU (``cuda_clean`` in ``tests/conftest.py``: cache given back, cuBLAS's workspace made by a
warm-up before any baseline is read) and fills it only through ``vram_blocker``, which gives the memory back.
"""

from __future__ import annotations

import gc
from functools import partial

import pytest
import torch
from safetensors.torch import save_file

from core.detection.headers import read_header
from core.devices.backends import backend_of
from core.devices.memory import capacity_bytes, empty_cache, free_bytes
from core.devices.pinned import PinnedMemory
from core.devices.transfer import to_target
from core.files.reader import WeightReader
from core.files.skeleton import materialize, weights_on_meta
from core.placement.engine import partial_model_of
from core.placement.rings import settle
from core.weights import ops

CUDA = torch.device("cuda", 0)


@pytest.mark.gpu(proves="a copy on the side stream is complete before the compute stream uses it, pinned or not")
def test_side_stream_copies_are_ordered_before_use():
    host = torch.randn(4096, 4096)
    assert backend_of(CUDA).side_stream(CUDA) is not None
    moved = to_target(host, CUDA)
    assert torch.equal((moved * 2).cpu(), host * 2)
    pinned = PinnedMemory()
    assert pinned.lock(host, CUDA)
    moved = to_target(host, CUDA)
    assert torch.equal((moved + 1).cpu(), host + 1)
    pinned.unlock(host)
    assert pinned.pinned_bytes == 0


@pytest.mark.gpu(proves="pinning stops at its cap and a failed pin leaves the tensor usable")
def test_pinning_respects_its_cap():
    pinned = PinnedMemory(max_bytes=4 * 1024**2)
    small, large = torch.zeros(1024**2 // 4), torch.zeros(2 * 1024**2)
    assert pinned.lock(small, CUDA) and not pinned.lock(large, CUDA)
    assert pinned.pinned_bytes == 1024**2 and large.sum().item() == 0
    pinned.unlock(small)


@pytest.mark.gpu(proves="a slab is page-locked in place at its own size, counted, unlocked on demand or when freed")
def test_slabs_are_locked_at_their_size_and_counted_until_unlocked_or_freed():
    pinned = PinnedMemory(max_bytes=64 * 1024**2)
    block = torch.empty(41 * 1024**2, dtype=torch.uint8)  # not a power of two: nothing rounded up
    assert pinned.lock(block, CUDA) and block.is_pinned() and pinned.pinned_bytes == 41 * 1024**2
    assert not pinned.lock(torch.empty(41 * 1024**2, dtype=torch.uint8), CUDA)  # over the cap
    moved = torch.empty_like(block, device=CUDA)
    moved.copy_(block, non_blocking=True)
    torch.cuda.synchronize(CUDA)
    pinned.unlock(block)
    assert not block.is_pinned() and pinned.pinned_bytes == 0
    assert pinned.lock(block, CUDA)  # again: a model placed again
    del block, moved
    gc.collect()
    assert pinned.pinned_bytes == 0


@pytest.mark.gpu(proves="the free and total memory the engine plans with match the driver's figures")
def test_memory_figures_come_from_the_driver():
    free, total = torch.cuda.mem_get_info(CUDA)
    assert capacity_bytes(CUDA) == total
    assert free <= free_bytes(CUDA) <= total
    empty_cache(CUDA)


@pytest.mark.gpu(proves="streamed layers of a partially loaded model are pinned, and unpinned when resident")
def test_streamed_layers_are_pinned_and_released():
    from core.devices.pinned import pinned_memory

    net = torch.nn.Sequential(*(ops.Linear(1024, 1024) for _ in range(8)))
    engine = partial_model_of(net)
    layer = engine.layers()[0].nbytes
    engine.load(CUDA, 2 * layer + 3 * layer)
    assert pinned_memory().pinned_bytes > 0
    x = torch.randn(2, 1024, device=CUDA)
    assert net(x).device == CUDA
    engine.unload_all()
    assert pinned_memory().pinned_bytes == 0


@pytest.mark.gpu(proves="a real CUDA out-of-memory during a move triggers the guard and the model keeps working")
def test_real_out_of_memory_is_guarded(vram_blocker):
    net = torch.nn.Sequential(*(ops.Linear(4096, 4096) for _ in range(4)))
    total = partial_model_of(net).total_bytes()
    vram_blocker.leave(total // 2, CUDA)  # room for half
    try:
        report = partial_model_of(net).load(CUDA, total)
        assert report.oom is not None and report.resident_bytes < total
        assert net(torch.randn(1, 4096, device=CUDA)).device == CUDA
    finally:
        partial_model_of(net).unload_all()


@pytest.mark.gpu(count=2, proves="two models on two GPUs take their own VRAM; a move between GPUs frees the first")
def test_two_gpus_hold_a_model_each_and_a_move_between_them_frees_the_first():
    first, second = torch.device("cuda", 0), torch.device("cuda", 1)
    unet = torch.nn.Sequential(*(ops.Linear(2048, 2048) for _ in range(4)))
    encoder = torch.nn.Sequential(*(ops.Linear(1024, 1024) for _ in range(4)))
    x = torch.randn(2, 2048)
    expected = unet(x)
    base = torch.cuda.memory_allocated(first), torch.cuda.memory_allocated(second)
    unet_bytes = partial_model_of(unet).total_bytes()
    partial_model_of(unet).load(first, unet_bytes)
    partial_model_of(encoder).load(second, partial_model_of(encoder).total_bytes())
    assert torch.cuda.memory_allocated(first) - base[0] == unet_bytes
    assert torch.cuda.memory_allocated(second) - base[1] == partial_model_of(encoder).total_bytes()
    partial_model_of(unet).load(second, unet_bytes)
    assert torch.cuda.memory_allocated(first) == base[0]
    assert torch.allclose(unet(x.to(second)).cpu(), expected, atol=1e-3)  # GPU kernels round differently
    partial_model_of(unet).unload_all()
    partial_model_of(encoder).unload_all()
    assert (torch.cuda.memory_allocated(first), torch.cuda.memory_allocated(second)) == base


@pytest.mark.gpu(
    proves="the ring copies groups on the side stream into its slots, ahead of use; same result as on the host; only "
    "the ring beside the resident layers while sampling, nothing after it ends; slabs page-locked"
)
def test_the_ring_on_a_real_gpu_gives_the_same_result_and_leaves_nothing_behind_when_sampling_ends():
    torch.manual_seed(0)
    net = torch.nn.Sequential(*(ops.Linear(2048, 2048) for _ in range(8)))
    x = torch.randn(4, 2048)
    with torch.no_grad():
        expected = net(x)
    engine = partial_model_of(net)
    layer = engine.layers()[0].nbytes
    x = x.to(CUDA)
    base = torch.cuda.memory_allocated(CUDA)
    engine.load(CUDA, (2 + 3) * layer)  # two layers resident, six streaming through the ring
    assert engine.ring.host_bytes[0] > 0 and all(group.block.is_pinned() for group in engine.ring._slabs)
    with torch.no_grad():
        first = net(x)
        second = net(x)  # the next pass's first group was copied ahead at the end of the first
    torch.cuda.synchronize(CUDA)
    assert engine.ring.stats.ahead > 0 and torch.equal(first, second)
    torch.testing.assert_close(first.cpu(), expected, rtol=1e-3, atol=1e-3)  # TF32 / kernel order on the GPU
    del first, second
    assert torch.cuda.memory_allocated(CUDA) - base == engine.resident_bytes(CUDA) + engine.ring.ring_bytes
    settle(net)  # sampling ended
    assert torch.cuda.memory_allocated(CUDA) - base == engine.resident_bytes(CUDA)
    engine.unload_all()
    assert torch.cuda.memory_allocated(CUDA) == base


@pytest.mark.gpu(proves="a weight rewritten in place after sampling settled reaches the GPU as it is now")
def test_a_weight_written_in_place_between_runs_is_copied_as_it_is_now():
    torch.manual_seed(0)
    net = torch.nn.Sequential(*(ops.Linear(1024, 1024) for _ in range(8)))
    engine = partial_model_of(net)
    engine.load(CUDA, 5 * engine.layers()[0].nbytes)
    x = torch.randn(2, 1024, device=CUDA)
    with torch.no_grad():
        net(x)
        net(x)
        settle(net)  # what the patcher does before ComfyUI's hooks rewrite weights
        for layer in net:
            layer.weight.data.mul_(0.5)  # on the host for streamed layers, on the GPU for resident ones
        got = net(x)
        expected = x.cpu()
        for layer in net:
            expected = torch.nn.functional.linear(expected, layer.weight.cpu(), layer.bias.cpu())
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-3, atol=1e-3)
    engine.unload_all()


def _weights_file(tmp_path, layers: int, width: int):
    """A file with ``layers`` square weights, and the module tree (on meta) that reads it."""
    tensors = {f"{n}.weight": torch.randn(width, width) for n in range(layers)}
    path = tmp_path / "weights.safetensors"
    save_file(tensors, str(path))
    with weights_on_meta():
        net = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
    return read_header(path), tensors, net


@pytest.mark.gpu(proves="a loader's fill writes each weight straight into VRAM, read from the file, never whole in RAM")
def test_weights_are_written_straight_into_vram(tmp_path):
    header, tensors, net = _weights_file(tmp_path, 4, 4096)
    base = torch.cuda.memory_allocated(CUDA)
    with WeightReader(header, pin_for=torch.device("cuda")) as reader:
        materialize(net, {name: name for name in tensors}, reader, partial(backend_of(CUDA).empty, CUDA))
    assert all(p.device == CUDA and isinstance(p, torch.nn.Parameter) for p in net.parameters())
    assert torch.cuda.memory_allocated(CUDA) - base == sum(t.numel() * t.element_size() for t in tensors.values())
    assert all(torch.equal(net[n].weight.cpu(), tensors[f"{n}.weight"]) for n in range(4))
    del net
    assert torch.cuda.memory_allocated(CUDA) == base


@pytest.mark.gpu(proves="a real out-of-memory during a fill is raised as torch's, and what was filled is given back")
def test_a_fill_that_runs_out_of_vram_gives_back_what_it_filled(tmp_path, vram_blocker):
    header, tensors, net = _weights_file(tmp_path, 8, 4096)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    vram_blocker.leave(total // 2, CUDA)  # room for about half
    base = torch.cuda.memory_allocated(CUDA)
    with WeightReader(header) as reader, pytest.raises(torch.OutOfMemoryError):
        materialize(net, {name: name for name in tensors}, reader, partial(backend_of(CUDA).empty, CUDA))
    del net
    assert torch.cuda.memory_allocated(CUDA) == base
