"""A model held split (``core.placement.split_model``): put in place in both modes with its patches applied,
read per device from the tensors, let go of when someone else moves it, released with every weight restored; a
device out of memory gives everything back. Then the same on two real GPUs (skipped without them)."""

from __future__ import annotations

import gc

import pytest
import torch

from core.devices.sim.cost import LinkCost
from core.devices.sim.device import SimulatedDevice
from core.devices.tensors import HOST
from core.devices.transfer import to_target
from core.errors import DeviceControlError
from core.placement.allocation import parse_allocation
from core.placement.pipeline import hop
from core.placement.plan import layers_of
from core.placement.split_model import SplitRequest, load_split, plan_split, split_of
from core.placement.streaming import LayerHooks
from core.weights import ops
from tests.core.faults import OUT_OF_MEMORY, fail_moves
from tests.core.split_net import WIDTH, FluxShaped, inputs


class Doubling(LayerHooks):
    """A stand-in owner's patch: doubles every weight before it becomes resident, restores it when it leaves."""

    def __init__(self) -> None:
        self.backup: dict[int, torch.Tensor] = {}

    def before_resident(self, layer, target) -> None:
        weight = getattr(layer.module, "weight", None)
        if weight is not None and id(layer.module) not in self.backup:
            self.backup[id(layer.module)] = weight.data.clone()
            weight.data.mul_(2)

    def before_leaving(self, layer) -> None:
        saved = self.backup.pop(id(layer.module), None)
        if saved is not None:
            layer.module.weight.data.copy_(saved)


def _request(net: torch.nn.Module, mode: str, text: str = "gpu:0=40%, gpu:1=40%, cpu=*") -> SplitRequest:
    return SplitRequest(net, (net,), layers_of(net), parse_allocation(text), mode, HOST)


def _doubled(net: torch.nn.Module) -> torch.nn.Module:
    twin = FluxShaped()
    with torch.no_grad():
        for module in twin.modules():
            if getattr(module, "weight", None) is not None:
                module.weight.mul_(2)
    return twin


@pytest.mark.parametrize("mode", ["pipeline", "stream"])
def test_a_split_holds_its_parts_computes_the_patched_result_and_releases_everything(mode):
    net = FluxShaped()
    img, t = inputs()
    pristine = {name: tensor.clone() for name, tensor in net.state_dict().items()}
    with torch.no_grad():
        expected = _doubled(net)(img, t)
    gpus = SimulatedDevice(1 << 30, ordinal=0), SimulatedDevice(1 << 30, ordinal=1)
    targets = {"gpu:0": gpus[0], "gpu:1": gpus[1], "cpu": HOST}
    request = _request(net, mode)
    hooks = Doubling()
    held = load_split(request, plan_split(request), targets, hooks)
    assert split_of(net) is held
    per_device = dict(held.per_device())
    assert per_device["gpu:1"] == gpus[1].allocated() > 0 and per_device["gpu:0"] == gpus[0].allocated() > 0
    assert sum(per_device.values()) == sum(layer.nbytes for layer in layers_of(net))
    with torch.no_grad():
        out = net(img, t)  # the caller's tensors are in RAM (home); the output comes back there
    assert torch.equal(out.cpu(), expected)
    del out
    gc.collect()
    assert held.release(hooks) == per_device["gpu:0"] + per_device["gpu:1"]
    assert gpus[0].allocated() == 0 and gpus[1].allocated() == 0 and split_of(net) is None
    assert all(torch.equal(net.state_dict()[name], value) for name, value in pristine.items())  # restored
    with torch.no_grad():
        assert torch.equal(net(img, t), FluxShaped()(img, t))  # no hook left behind


def test_a_split_moved_by_someone_else_is_let_go_of_and_the_model_runs_where_it_is():
    net = FluxShaped()
    img, t = inputs()
    gpus = SimulatedDevice(1 << 30, ordinal=0), SimulatedDevice(1 << 30, ordinal=1)
    request = _request(net, "pipeline", "gpu:0=50%, gpu:1=*")
    load_split(request, plan_split(request), {"gpu:0": gpus[0], "gpu:1": gpus[1]})
    net.to("cpu")  # another loader takes every weight back to RAM
    assert split_of(net) is None
    with torch.no_grad():
        out = net(img, t)
    assert not hasattr(out, "sim_device") and torch.equal(out, FluxShaped()(img, t))
    assert not net._forward_pre_hooks and not net.double_blocks[0]._forward_pre_hooks  # the hooks came off


def test_a_device_out_of_memory_gives_every_layer_back_to_ram():
    net = FluxShaped()
    total = sum(layer.nbytes for layer in layers_of(net))
    small = SimulatedDevice(total // 10, ordinal=1)
    request = _request(net, "pipeline", "gpu:0=50%, gpu:1=*")
    big = SimulatedDevice(1 << 30, ordinal=0)
    with pytest.raises(DeviceControlError, match="gpu:1 ran out of memory"):
        load_split(request, plan_split(request), {"gpu:0": big, "gpu:1": small})
    assert big.allocated() == 0 and small.allocated() == 0 and split_of(net) is None


@pytest.mark.parametrize("kind", ["cuda runtime (AcceleratorError)", "hip runtime", "mps allocator"])
def test_a_device_out_of_memory_raised_by_its_runtime_gives_every_layer_back_to_ram(monkeypatch, kind):
    """An out-of-memory that is not ``torch.OutOfMemoryError`` (a CUDA call under memory pressure raises
    ``torch.AcceleratorError``) is the same clear error, with every layer back in RAM."""
    net = FluxShaped()
    request = _request(net, "pipeline", "gpu:0=50%, gpu:1=*")
    big, other = SimulatedDevice(1 << 30, ordinal=0), SimulatedDevice(1 << 30, ordinal=1)
    fail_moves(monkeypatch, other, OUT_OF_MEMORY[kind], 2)
    with pytest.raises(DeviceControlError, match="gpu:1 ran out of memory"):
        load_split(request, plan_split(request), {"gpu:0": big, "gpu:1": other})
    gc.collect()
    assert big.allocated() == 0 and other.allocated() == 0 and split_of(net) is None


class Transformer(torch.nn.Module):
    def __init__(self, linear: type[torch.nn.Linear] = torch.nn.Linear) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(linear(WIDTH, WIDTH) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class TextEncoderShaped(torch.nn.Module):
    """A text encoder's shape (ComfyUI's ``SDClipModel``): the caller's embeddings and mask are on one device, its
    transformer runs, and the output is joined with the mask outside the transformer."""

    def __init__(self, linear: type[torch.nn.Linear] = torch.nn.Linear) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.transformer = Transformer(linear)

    def forward(self, embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.transformer(embeds) * mask


@pytest.mark.parametrize("mode", ["pipeline", "stream"])
def test_a_text_encoder_split_gives_its_output_back_beside_the_callers_mask(mode):
    encoder = TextEncoderShaped()
    embeds, mask = torch.randn(2, 5, WIDTH), (torch.rand(2, 5, 1) > 0.3).float()
    with torch.no_grad():
        expected = encoder(embeds, mask)
    gpus = SimulatedDevice(1 << 30, ordinal=0), SimulatedDevice(1 << 30, ordinal=1)
    targets = {"gpu:0": gpus[0], "gpu:1": gpus[1]}
    allocation = parse_allocation("gpu:0=50%, gpu:1=*")
    on_gpu0 = hop(embeds, gpus[0]), hop(mask, gpus[0])  # where the caller builds them
    if mode == "pipeline":  # without giving the transformer's output back, it stays on gpu:1, away from the mask
        without = SplitRequest(encoder, (encoder,), layers_of(encoder), allocation, mode, gpus[0])
        held = load_split(without, plan_split(without), targets)
        with torch.no_grad(), pytest.raises(RuntimeError, match="same device"):
            encoder(*on_gpu0)
        held.release()
    request = SplitRequest(
        encoder, (encoder,), layers_of(encoder), allocation, mode, gpus[0], to_caller=(encoder.transformer,)
    )
    held = load_split(request, plan_split(request), targets)
    assert sum(n for _d, n in held.per_device()) == sum(layer.nbytes for layer in layers_of(encoder))
    with torch.no_grad():
        out = encoder(*on_gpu0)
    assert out.sim_device is gpus[0] and torch.equal(out.cpu(), expected)
    held.release()


@pytest.mark.parametrize("once", [False, True], ids=["step after step", "once per use"])
def test_a_streamed_text_encoder_leaves_no_copy_queued_for_a_call_that_may_not_come(once):
    """A sampler calls a diffusion model step after step, so its last layers copy the next step's first ahead (the
    patcher drops them when sampling ends); a text encoder encodes a prompt and is not called again until the
    next one, so its last layer queues nothing for a next call."""
    encoder = TextEncoderShaped(ops.Linear)  # the pack's cast layers stream from a donor
    embeds, mask = torch.randn(2, 5, WIDTH), torch.ones(2, 5, 1)
    gpus = SimulatedDevice(1 << 30, ordinal=0), SimulatedDevice(1 << 30, ordinal=1)
    request = SplitRequest(
        encoder,
        (encoder,),
        layers_of(encoder),
        parse_allocation("gpu:0=50%, gpu:1=*"),
        "stream",
        gpus[0],
        to_caller=(encoder.transformer,),
        once_per_use=once,
    )
    held = load_split(request, plan_split(request), {"gpu:0": gpus[0], "gpu:1": gpus[1]})
    own = gpus[0].allocated()
    for _ in range(3):  # the first call learns the order, the second the first layer after the last
        with torch.no_grad():
            encoder(hop(embeds, gpus[0]), hop(mask, gpus[0]))
    gc.collect()
    rings = held.streamed.rings
    assert sum(ring.stats.ahead for ring in rings) > 0
    held_bytes = sum(ring.ring_bytes for ring in rings)
    assert (held_bytes == 0) is once and (gpus[0].allocated() == own) is once
    held.release()


@pytest.mark.gpu(count=2, proves="pipeline and stream over two real GPUs give the one-GPU output, each GPU its part")
@pytest.mark.parametrize("mode", ["pipeline", "stream"])
def test_two_real_gpus_hold_their_parts_and_compute_the_one_gpu_result(mode):
    cuda = torch.device("cuda", 0), torch.device("cuda", 1)
    img, t = (x.to(cuda[0]) for x in inputs())
    with torch.no_grad():
        expected = FluxShaped().to(cuda[0])(img, t).cpu()
    net = FluxShaped()
    before = [torch.cuda.memory_allocated(device) for device in cuda]
    request = SplitRequest(net, (net,), layers_of(net), parse_allocation("gpu:0=50%, gpu:1=*"), mode, cuda[0])
    held = load_split(request, plan_split(request), {"gpu:0": cuda[0], "gpu:1": cuda[1]})
    for device, was, (_name, part) in zip(cuda, before, held.per_device(), strict=True):
        assert torch.cuda.memory_allocated(device) - was >= part > 0
    with torch.no_grad():
        out = net(img, t)
    assert out.device == cuda[0] and torch.allclose(out.cpu(), expected, rtol=1e-5, atol=1e-6)
    held.release()
    assert torch.cuda.memory_allocated(cuda[1]) == before[1]


def test_a_donor_gpus_weight_copied_leaves_the_host_free_and_an_activation_gets_memory_of_its_own():
    """A copy between two GPUs needs no host work (as on CUDA, where it is a copy on the devices' streams): a
    donor's weight copied for a layer the ring cannot serve returns before its copy ends; a blocking copy (an
    activation hop) is the data again in memory of its own, which the next block may change in place."""
    link = LinkCost.parse("1GB/s,0us")
    gpus = SimulatedDevice(1 << 30, ordinal=0, link=link), SimulatedDevice(1 << 30, ordinal=1, link=link)
    weight = gpus[1].place(torch.randn(64 * 1024**2 // 4))  # 64 MiB: 67 ms on this link
    waited = gpus[0].link.host_wait_seconds
    moved = to_target(weight, gpus[0])
    assert gpus[0].link.host_wait_seconds - waited < 0.01, "the host waited for a copy between two GPUs"
    assert moved.sim_device is gpus[0] and torch.equal(moved.cpu(), weight.cpu())
    assert gpus[0].allocated() == 64 * 1024**2 and gpus[1].allocated() == 64 * 1024**2
    hopped = hop(weight, gpus[0])
    hopped.add_(1)
    assert not torch.equal(hopped.cpu(), weight.cpu())
