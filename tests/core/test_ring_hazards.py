"""The ring where a real GPU was hurt: page-locked ranges that share a page, a ring a model run once per use never
gave back, an allocation tried again at every layer, groups crossing more than once a pass, and slabs the cap left
pageable stopping the host at every group.

Each runs the product's engine and cast layers on a simulated GPU (``core.devices``), as ``test_ring.py`` does.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import torch

from core.devices.host_memory import page_size
from core.devices.pinned import pinned_memory
from core.devices.sim.cost import LinkCost
from core.devices.sim.device import SimulatedDevice
from core.placement import rings
from core.placement.engine import partial_model_of
from core.placement.prefetch import PREFETCH_SLOTS
from core.placement.ring import Ring
from core.placement.slabs import layer_bytes, tensors_of
from core.weights import ops
from tests.core.order_net import on_host, streamed_net
from tests.core.platform_marks import STREAMS_AND_PINNING
from tests.core.small_net import reserve_of, width

MiB = 1024**2


def test_slabs_start_on_a_page_hold_whole_pages_and_give_each_tensor_pages_of_its_own():
    """Two page-locked ranges never share a page: not two slabs, nor two weights ComfyUI may lock one by one in
    a slab its model left unlocked (a second registration of a page fails, and CUDA reports it at the next
    kernel)."""
    net, _device, _x = streamed_net(resident_layers=0)
    groups = partial_model_of(net).ring._slabs
    assert groups
    for group in groups:
        start = group.block.data_ptr()
        assert start % page_size() == 0 and group.nbytes % page_size() == 0 and group.block.numel() == group.nbytes
        offsets = [tensor.data_ptr() - start for module in group.modules for _name, tensor in tensors_of(module)]
        assert all(offset % page_size() == 0 for offset in offsets)


class Decoder(torch.nn.Module):
    """A VAE decoder's shape: its up blocks run in the reverse of their registration, after ``conv_in``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_in = ops.Linear(width(), width())
        self.up = torch.nn.ModuleList(ops.Linear(width(), width()) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.run_order():
            x = layer(x)
        return x

    def run_order(self) -> list[torch.nn.Module]:
        return [self.conv_in, *reversed(self.up)]


class Vae(torch.nn.Module):
    """A VAE's shape: an encoder and a decoder, and ``post_quant_conv`` registered last but run first by
    ``decode`` (not ``forward``), as ComfyUI's ``AutoencoderKL`` has them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torch.nn.Sequential(*(ops.Linear(width(), width()) for _ in range(3)))
        self.decoder = Decoder()
        self.post_quant_conv = ops.Linear(width(), width())

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.post_quant_conv(x))

    def decoded_on_host(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.post_quant_conv, *self.decoder.run_order()):
            x = torch.nn.functional.linear(x, layer.weight, layer.bias)
        return x


def test_a_model_run_once_per_use_gives_its_ring_back_whatever_order_its_layers_run_in():
    vae = Vae()
    device = SimulatedDevice(64 * MiB)
    engine = partial_model_of(vae)
    engine.load(device, reserve_of(engine.layers()[:1]))  # everything streams
    engine.ring.wraps = False
    x = torch.randn(2, width(), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = vae.decoded_on_host(x)
        for _use in range(3):
            out = vae.decode(device.place(x)).cpu()
            gc.collect()
            assert engine.ring.ring_bytes == 0 and device.allocated() == 0  # nothing streamed stays after a use
            assert torch.equal(out, expected)
    assert engine.ring.stats.copies > 0


def test_a_vae_decode_is_one_use_with_its_decoders_whole_order_learned():
    """ComfyUI decodes with ``post_quant_conv``, then the decoder: one use, whose end gives the ring back. The ring
    is allocated once a decode, the order it learns is the whole decode's (not ``post_quant_conv``'s alone, with
    the decoder in registration order), and once learned each group crosses once a decode and none is copied
    ahead for the encoder, which a decode does not run (issue 57, item 1)."""
    vae, device = Vae(), SimulatedDevice(64 * MiB)
    layers = [module for module in vae.modules() if isinstance(module, ops.Linear)]  # registration order
    for layer in layers:
        layer.comfy_cast_weights = True  # as the engine marks the layers it streams
    ring = Ring(vae)
    ring.wraps = False
    ring.attach(layers, device, PREFETCH_SLOTS * 3 * layer_bytes(layers[0]))  # groups of three layers
    x = torch.randn(2, width(), generator=torch.Generator().manual_seed(1))
    copies = []
    with torch.no_grad():
        for decode in range(5):
            before = ring.stats.copies
            out = vae.decode(device.place(x)).cpu()
            copies.append(ring.stats.copies - before)
            assert ring.stats.allocations == decode + 1 and ring.ring_bytes == 0
            assert torch.equal(out, vae.decoded_on_host(x))
    # Eight layers run, three a group: three groups a decode, once the end of a decode was seen twice.
    assert copies[-2:] == [3, 3], copies


def test_a_ring_without_room_tries_again_only_after_sampling_settles(caplog):
    net, device, x = streamed_net()
    engine = partial_model_of(net)
    x = device.place(x)
    slot = max(group.nbytes for group in engine.ring._groups)
    # Room for a layer's own copies, not for one slot of the ring.
    blocker = device.place(torch.empty(device.free() - slot + 512, dtype=torch.uint8))
    with caplog.at_level(logging.WARNING, logger="device_control"):
        out = net(x)
        net(x)
    # One warning for the whole sampling call, not one free-and-retry per group (each a device synchronisation).
    assert len([r for r in caplog.records if "streaming slots" in r.getMessage()]) == 1
    assert engine.ring.ring_bytes == 0 and engine.ring.stats.copies == 0
    assert torch.equal(out.cpu(), on_host(net, x.cpu()))
    del blocker
    rings.settle(net)  # sampling ended: the next one tries again, and finds room
    net(x)
    assert engine.ring.ring_bytes > 0


class Block(torch.nn.Module):
    """A transformer block's registration order (attn1, ff, attn2, norms) against its run order (norm1, attn1,
    norm2, attn2, norm3, ff)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn1 = ops.Linear(width(), width())
        self.ff_in = ops.Linear(width(), 3 * width())
        self.ff_out = ops.Linear(3 * width(), width())
        self.attn2 = ops.Linear(width(), width())
        self.norm2 = ops.Linear(width(), width())
        self.norm1 = ops.Linear(width(), width())
        self.norm3 = ops.Linear(width(), width())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.norm1, self.attn1, self.norm2, self.attn2, self.norm3, self.ff_in, self.ff_out):
            x = layer(x)
        return x


def run_order(block: Block) -> tuple[torch.nn.Module, ...]:
    return (block.norm1, block.attn1, block.norm2, block.attn2, block.norm3, block.ff_in, block.ff_out)


def test_groups_are_packed_in_the_order_the_model_runs_in_so_each_crosses_once_a_pass():
    torch.manual_seed(0)
    net = torch.nn.Sequential(Block(), Block(), Block())
    device = SimulatedDevice(64 * MiB)
    engine = partial_model_of(net)
    engine.load(device, reserve_of(engine.layers()))
    ring = engine.ring
    x = torch.randn(2, width(), generator=torch.Generator().manual_seed(1))
    expected = x
    with torch.no_grad():
        for layer in (layer for block in net for layer in run_order(block)):
            expected = torch.nn.functional.linear(expected, layer.weight, layer.bias)
        first = net(device.place(x)).cpu()
        net(device.place(x))
        net(device.place(x))
        copies = ring.stats.copies
        last = net(device.place(x)).cpu()
    ran = [id(layer) for block in net for layer in run_order(block)]
    assert ring.stats.reordered == 1
    assert [id(module) for group in ring._slabs for module in group.modules] == ran
    assert ring.stats.copies - copies == len(ring._groups) < len(ran)  # each group once a pass
    assert torch.equal(first, expected) and torch.equal(last, expected)


@STREAMS_AND_PINNING
def test_slabs_the_pinned_cap_left_pageable_cross_through_staging_without_the_host_waiting(monkeypatch):
    """Past the pinned-memory cap, a slab stays pageable; a copy from pageable memory makes the host wait for it
    (and, on the side stream, for the computation before it). Staged through a small page-locked buffer, it does
    not."""
    monkeypatch.setattr(pinned_memory(), "max_bytes", 0)
    link = LinkCost(bandwidth=1e8, pageable_bandwidth=1e7)
    net, device, x = streamed_net(resident_layers=0, link=link)
    ring = partial_model_of(net).ring
    assert ring.host_bytes[0] == 0 and ring.host_bytes[1] > 0  # no slab page-locked
    with torch.no_grad():
        out = net(device.place(x))
    pageable = sum(group.nbytes for group in ring._groups) / link.pageable_bandwidth
    assert ring.stats.staged == ring.stats.copies == len(ring._groups) + 1  # and the next step's first group
    assert device.link.host_wait_seconds < pageable / 2
    assert torch.equal(out.cpu(), on_host(net, x))
    staging = [block.data_ptr() for block in ring._staging._blocks]
    ring.detach()
    assert staging and not any(pointer in pinned_memory().blocks for pointer in staging)  # unlocked with the ring


def test_one_streaming_engine_no_per_tensor_lookahead_and_no_record_stream():
    """Row slices and a split model's donors stream through rings too: nothing in the pack queues a copy per
    tensor ahead of use, or keeps a tensor alive for another stream with ``record_stream``."""
    root = Path(__file__).resolve().parents[2]
    sources = [path for folder in ("core", "nodes") for path in (root / folder).rglob("*.py")]
    for word in (".record_stream(", "def queue_copy", "class Lookahead"):
        assert not [path.name for path in sources if word in path.read_text(encoding="utf-8")], word
