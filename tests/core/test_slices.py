"""Row slices: where they fall, and a layer streamed in slices computing bit for bit what it computes streamed
whole, for every layer type that slices and every storage dtype, on a simulated GPU that checks every copy is
waited for and books every byte."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.nn import functional as F  # noqa: N812

from core.devices.sim.device import SimulatedDevice
from core.devices.slices import ROW_QUANTUM, SLICEABLE, SLICES, RowSlices, row_geometry, row_slices
from core.placement.plan import Layer
from core.placement.streaming import NO_HOOKS, reset_flags, stream
from core.weights import ops

MiB = 1024**2
FP8 = torch.float8_e4m3fn


def test_slices_hold_multiples_of_64_rows_within_the_unit_as_even_as_that_allows():
    slices = row_slices(rows=3072, row_bytes=4 * 3072, unit=16 * MiB, multiple=ROW_QUANTUM, extra=4 * 3072)
    assert slices is not None and slices.bounds[0] == 0 and slices.bounds[-1] == 3072
    sizes = [stop - start for start, stop in slices.ranges()]
    assert all(size % ROW_QUANTUM == 0 for size in sizes)
    assert max(sizes) * 4 * 3072 + 4 * 3072 <= 16 * MiB
    assert max(sizes) - min(sizes) <= ROW_QUANTUM * len(sizes)  # even, but for the multiple
    assert row_slices(rows=256, row_bytes=1024, unit=16 * MiB, multiple=ROW_QUANTUM) is None  # fits: whole
    one = row_slices(rows=1024, row_bytes=MiB, unit=MiB, multiple=ROW_QUANTUM)  # not one row fits: one multiple
    assert one is not None and one.largest == ROW_QUANTUM
    assert row_slices(rows=1024, row_bytes=1024, unit=200 * 1024, multiple=192).aligned_to(192)


def test_only_linears_and_single_group_convolutions_whose_rows_are_64_multiples_slice():
    assert getattr(ops.Linear, SLICEABLE) and row_geometry(ops.Linear(16, 128)) == (128, 16 * 4)
    assert row_geometry(ops.Conv2d(8, 64, 3)) == (64, 8 * 9 * 4)
    assert row_geometry(ops.Conv2d(8, 64, 3, groups=8)) is None  # a group mixes rows with its own inputs only
    assert row_geometry(ops.Linear(16, 100)) is None  # an odd row count streams whole (see core.devices.slices)
    assert row_geometry(ops.LayerNorm(128)) is None and row_geometry(ops.Embedding(128, 8)) is None
    assert row_geometry(torch.nn.Linear(16, 128)) is None  # not a cast layer: it has no sliced forward


@pytest.mark.parametrize(("rows", "inner", "batch"), [(21504, 3072, 2), (9216, 3072, 300), (3072, 768, 77)])
def test_the_host_library_splits_a_product_by_64_row_slices_bit_for_bit(rows, inner, batch):
    """What slicing relies on: the rows of x @ W.T (and of up @ down, a LoRA's product) computed for a slice are
    the whole product's, for layer shapes of the families the pack proves (odd widths are not sliced)."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(batch, inner, generator=generator)
    weight, bias = torch.randn(rows, inner, generator=generator), torch.randn(rows, generator=generator)
    up, down = torch.randn(rows, 16, generator=generator), torch.randn(16, inner, generator=generator)
    whole, product = F.linear(x, weight, bias), up @ down
    for start, stop in row_slices(rows, inner * 4, 8 * MiB, ROW_QUANTUM).ranges():
        assert torch.equal(F.linear(x, weight[start:stop], bias[start:stop]), whole[:, start:stop])
        assert torch.equal(up[start:stop] @ down, product[start:stop])


def _layer(kind: str) -> tuple[torch.nn.Module, torch.Tensor, RowSlices]:
    """A cast layer with 256 output rows (or channels), an input for it, and uneven 64-multiple slices."""
    torch.manual_seed(0)
    layers = {
        "linear": (ops.Linear(96, 256), torch.randn(5, 96)),
        "linear-3d": (ops.Linear(96, 256), torch.randn(2, 7, 96)),
        "conv1d": (ops.Conv1d(8, 256, 3, padding=1), torch.randn(2, 8, 11)),
        "conv2d": (ops.Conv2d(8, 256, 3, padding=1), torch.randn(2, 8, 6, 6)),
        "conv3d": (ops.Conv3d(4, 256, 3), torch.randn(1, 4, 4, 5, 5)),
    }
    layer, x = layers[kind]
    return layer, x, RowSlices((0, 128, 192, 256))


def _streamed(
    layer: torch.nn.Module, x: torch.Tensor, device: SimulatedDevice, slices: RowSlices | None, functions: tuple = ()
) -> torch.Tensor:
    """``layer``'s output on ``device``, its weights streamed from the host (in ``slices``, when given) with these
    weight ``functions``."""
    reset_flags(Layer("layer", layer, 0, True))
    stream(Layer("layer", layer, 0, True), device, NO_HOOKS, slices)
    layer.weight_function = list(functions)
    with torch.no_grad():
        out = layer(device.place(x))
    return device.release(out).clone()


STORAGE = [torch.float32, torch.float16, torch.bfloat16, FP8]


@pytest.mark.parametrize("storage", STORAGE, ids=str)
@pytest.mark.parametrize("kind", ["linear", "linear-3d", "conv1d", "conv2d", "conv3d"])
def test_a_layer_streamed_in_slices_computes_what_it_computes_whole(kind, storage):
    layer, x, slices = _layer(kind)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.5)
    layer.to(storage)
    device = SimulatedDevice(64 * MiB)
    for compute in (torch.float32, torch.bfloat16):
        whole = _streamed(layer, x.to(compute), device, None)
        sliced = _streamed(layer, x.to(compute), device, slices)
        assert sliced.dtype == whole.dtype == compute and torch.equal(sliced, whole), (kind, storage, compute)
    assert layer.weight.dtype == storage and SLICES in layer.__dict__  # stored as it was; still streaming in slices
    gc.collect()
    assert device.allocated() == 0  # every slice's copy was given back


@pytest.mark.parametrize("numel", ["weight-smaller", "input-smaller"])
def test_a_scaled_fp8_linear_in_slices_scales_as_the_whole_does(numel):
    """The scale goes on whichever operand is smaller: the whole weight decides, for every slice alike."""
    layer, x, slices = _layer("linear")
    if numel == "weight-smaller":
        x = torch.randn(400, 96)
    with torch.no_grad():
        layer.weight.copy_(torch.randn_like(layer.weight) * 0.5)
    layer.to(FP8)
    layer.bias.data = layer.bias.data.float()
    layer.scale_weight = torch.nn.Parameter(torch.tensor(0.37), requires_grad=False)
    device = SimulatedDevice(64 * MiB)
    assert torch.equal(_streamed(layer, x, device, slices), _streamed(layer, x, device, None))


def test_a_weight_function_that_cannot_take_slices_makes_the_layer_compute_whole():
    layer, x, slices = _layer("linear")
    device = SimulatedDevice(64 * MiB)
    functions = (lambda weight: weight * 2.0,)  # a plain callable: it knows nothing of rows
    assert torch.equal(_streamed(layer, x, device, slices, functions), _streamed(layer, x, device, None, functions))
    assert not torch.equal(_streamed(layer, x, device, slices, functions), _streamed(layer, x, device, slices))


class _RowPatch:
    """A weight function that takes slices: it adds its row index to every row."""

    def __init__(self, multiple: int) -> None:
        self.multiple = multiple
        self.calls: list[tuple[int, int]] = []

    def slice_multiple(self, shape: tuple[int, ...]) -> int:
        return self.multiple

    def rows(self, weight: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        self.calls.append((start, stop))
        return weight + torch.arange(start, stop, dtype=weight.dtype).unsqueeze(1)

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        self.calls.append((0, weight.shape[0]))
        return weight + torch.arange(weight.shape[0], dtype=weight.dtype).unsqueeze(1)


def test_a_weight_function_that_takes_slices_patches_each_slice_alone_or_the_whole_when_unaligned():
    layer, x, slices = _layer("linear")
    device = SimulatedDevice(64 * MiB)
    patch = _RowPatch(64)
    expected = _streamed(layer, x, device, None, (patch,))
    patch.calls = []
    assert torch.equal(_streamed(layer, x, device, slices, (patch,)), expected)
    assert patch.calls == slices.ranges()  # one patched slice at a time
    patch.multiple, patch.calls = 128, []  # slices start on 192: not a multiple of 128
    assert torch.equal(_streamed(layer, x, device, slices, (patch,)), expected) and patch.calls == [(0, 256)]


def test_a_sliced_layer_given_a_host_input_computes_whole_where_its_weight_is():
    """ComfyUI computes some inputs on the host even for a model on a device (a time embedding): nothing crosses."""
    layer, x, slices = _layer("linear")
    stream(Layer("layer", layer, 0, True), SimulatedDevice(64 * MiB), NO_HOOKS, slices)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
