"""The simulated GPU: capacity, exact books, real out-of-memory and device-mismatch behaviour."""

from __future__ import annotations

import gc

import pytest
import torch

from core.devices.marks import mark_streamed
from core.devices.sim.device import SimulatedDevice
from core.devices.sim.spec import SimulatedSpec
from core.devices.sim.tensor import SimTensor

MiB = 1024**2


@pytest.fixture
def device() -> SimulatedDevice:
    return SimulatedDevice(4 * MiB)


def test_place_counts_bytes_and_release_gives_them_back(device):
    weight = device.place(torch.zeros(256, 1024))  # 1 MiB of fp32
    assert isinstance(weight, SimTensor)
    assert weight.sim_device is device
    assert device.allocated() == 1 * MiB
    assert device.free() == 3 * MiB
    del weight
    gc.collect()
    assert device.allocated() == 0


def test_views_of_one_storage_count_once(device):
    weight = device.place(torch.zeros(256, 1024))
    views = [weight.t(), weight[0], weight.view(-1), weight.detach()]
    assert all(isinstance(v, SimTensor) for v in views)
    assert device.allocated() == 1 * MiB
    del weight
    gc.collect()
    assert device.allocated() == 1 * MiB  # the views still hold the storage, as on a real device
    del views
    gc.collect()
    assert device.allocated() == 0


def test_results_of_operations_are_resident_and_counted(device):
    x = device.place(torch.ones(256, 1024))
    y = x * 2
    assert isinstance(y, SimTensor)
    assert y.sim_device is device
    assert device.allocated() == 2 * MiB
    assert device.peak_allocated() == 2 * MiB
    del y
    gc.collect()
    assert device.allocated() == 1 * MiB
    assert device.peak_allocated() == 2 * MiB
    device.reset_peak()
    assert device.peak_allocated() == 1 * MiB


def test_over_capacity_raises_the_same_error_a_gpu_would(device):
    held = device.place(torch.zeros(3 * MiB // 4))  # 3 MiB
    with pytest.raises(torch.OutOfMemoryError, match=r"sim:0 out of memory.*Tried to allocate 2.00 MiB"):
        device.place(torch.zeros(MiB // 2))
    small = device.place(torch.zeros(MiB // 8))  # 0.5 MiB
    with pytest.raises(torch.OutOfMemoryError):  # an operation's output is an allocation too
        small.repeat(4)
    assert device.allocated() == 3.5 * MiB
    del held, small


def test_a_tensor_takes_the_block_a_caching_allocator_gives_it(device):
    """Bytes are booked as allocated and, in the most a block of CUDA's caching allocator takes (512-byte units; a
    segment's unsplit rest of up to 1 MiB above 1 MiB), as reserved, with a peak of each: a 1.25 MiB tensor
    reserves 2.25 MiB."""
    odd = device.place(torch.zeros(25, dtype=torch.uint8))
    large = device.place(torch.zeros(5 * MiB // 16))  # 1.25 MiB
    assert (device.allocated(), device.reserved()) == (25 + 5 * MiB // 4, 512 + 9 * MiB // 4)
    assert device.stats()["torch_reserved"] == device.peak_reserved() == 512 + 9 * MiB // 4
    del large
    device.reset_peak()
    assert device.peak_reserved() == device.reserved() == 512 and device.peak_allocated() == 25
    del odd


def test_used_by_others_lowers_what_is_free():
    device = SimulatedDevice(4 * MiB, used_by_others=3 * MiB)
    assert device.free() == 1 * MiB
    with pytest.raises(torch.OutOfMemoryError):
        device.place(torch.zeros(MiB // 2))


def test_forgotten_move_fails_like_a_device_mismatch(device):
    layer = torch.nn.Linear(16, 16)
    x = device.place(torch.randn(2, 16))
    with pytest.raises(RuntimeError, match=r"Expected all tensors to be on the same device.*sim:0 and cpu"):
        layer(x)
    # Once every weight is moved, the same layer computes, and the result stays on the device.
    layer.weight = torch.nn.Parameter(device.place(layer.weight), requires_grad=False)
    layer.bias = torch.nn.Parameter(device.place(layer.bias), requires_grad=False)
    out = layer(x)
    assert isinstance(out, SimTensor)
    assert isinstance(layer.weight, torch.nn.Parameter)


def test_two_simulated_devices_do_not_mix():
    first, second = SimulatedDevice(MiB, ordinal=0), SimulatedDevice(MiB, ordinal=1)
    a, b = first.place(torch.ones(4)), second.place(torch.ones(4))
    with pytest.raises(RuntimeError, match="sim:0 and sim:1"):
        _ = a + b
    with pytest.raises(RuntimeError, match="move it to the host"):
        second.place(a)


def test_host_inputs_count_as_uploaded_and_results_stay_on_the_device(device):
    x = device.place(torch.ones(4))
    assert isinstance(x * torch.tensor(2.0), SimTensor)  # a host scalar, as on a GPU
    noise = torch.randn(4)  # what a sampler creates on the compute device; here it arrives from the host
    assert isinstance(x + noise, SimTensor)


def test_a_streamed_weight_may_be_used_from_the_host(device):
    layer = torch.nn.Linear(16, 16)
    for param in layer.parameters():
        mark_streamed(param)  # left in RAM, cast to the device at each use
    out = layer(device.place(torch.randn(2, 16)))
    assert isinstance(out, SimTensor)
    mark_streamed(layer.weight, False)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        layer(device.place(torch.randn(2, 16)))


def test_moving_back_to_the_host_returns_plain_tensors(device):
    data = torch.arange(8.0)
    x = device.place(data)
    for back in (x.cpu(), x.to("cpu"), x.to(device="cpu", dtype=torch.float16), device.to_host(x)):
        assert type(back) is torch.Tensor
        assert torch.equal(back.float(), data)
    assert isinstance(x.to(torch.float16), SimTensor)  # a dtype change stays on the device
    assert isinstance(x.to(dtype=torch.float16, copy=True), SimTensor)
    host = torch.zeros(8)
    host.copy_(x)  # device-to-host copy is a transfer, not a mismatch
    assert torch.equal(host, data)


def test_place_is_idempotent_and_preserves_values(device):
    data = torch.randn(8, 8)
    x = device.place(data)
    assert device.place(x) is x
    assert torch.equal(device.to_host(x), data)


def test_stats_fault_is_injectable():
    device = SimulatedDevice(MiB, faults={"stats"})
    with pytest.raises(RuntimeError, match="injected fault"):
        device.stats()


def test_spec_parses_capacities_and_faults():
    spec = SimulatedSpec.parse("8GiB, 4GiB", "stats")
    assert spec.capacities == (8 * 1024**3, 4 * 1024**3)
    assert spec.faults == frozenset({"stats"})
    assert SimulatedSpec.parse(None).capacities == ()
    with pytest.raises(ValueError, match="unknown simulated fault"):
        SimulatedSpec.parse("1GiB", "explode")


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="positive capacity"):
        SimulatedDevice(0)


def test_module_to_moves_parameters_off_the_device_and_the_books_follow(device):
    layer = torch.nn.Linear(64, 64)
    expected = layer.weight.detach().clone()
    layer.weight = torch.nn.Parameter(device.place(layer.weight), requires_grad=False)
    layer.bias = torch.nn.Parameter(device.place(layer.bias), requires_grad=False)
    assert device.allocated() == 64 * 64 * 4 + 64 * 4
    layer.to(torch.float16)  # a dtype change stays on the device (set through Parameter.data)
    gc.collect()
    assert isinstance(layer.weight, SimTensor) and device.allocated() == (64 * 64 + 64) * 2
    layer.to("cpu")  # as ComfyUI offloads a model
    gc.collect()
    assert type(layer.weight) is torch.nn.Parameter and not isinstance(layer.weight, SimTensor)
    assert device.allocated() == 0
    assert torch.equal(layer.weight, expected.half())


def test_a_release_during_registration_does_not_deadlock(device):
    # A garbage collection inside the books' critical section runs finalizers in the same thread; they must
    # not wait for the lock the thread already holds.
    doomed = device.place(torch.zeros(1024))
    device._lock.acquire()
    try:
        doomed._sim_release()  # what a finalizer does
    finally:
        device._lock.release()
    del doomed
    gc.collect()
    assert device.allocated() == 0
