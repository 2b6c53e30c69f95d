"""Cast-on-the-fly layers: the protocol, exact results, reversible conversion, and the simulated GPU."""

from __future__ import annotations

import gc
import inspect

import pytest
import torch

from core.devices.sim.device import SimulatedDevice
from core.devices.sim.tensor import SimTensor
from core.weights import ops

MiB = 1024**2


def parameters_of(function) -> list[tuple]:
    """What a caller can pass: names, kinds and defaults (annotations may be strings on one side)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def make_layers() -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    return {
        "linear": (torch.nn.Linear(16, 8), torch.randn(3, 16)),
        "conv1d": (torch.nn.Conv1d(4, 6, 3), torch.randn(2, 4, 10)),
        "conv2d": (torch.nn.Conv2d(4, 6, 3, padding=1), torch.randn(2, 4, 8, 8)),
        "conv3d": (torch.nn.Conv3d(2, 3, 3), torch.randn(1, 2, 5, 5, 5)),
        "convtranspose1d": (torch.nn.ConvTranspose1d(4, 3, 3, stride=2), torch.randn(2, 4, 7)),
        "convtranspose2d": (torch.nn.ConvTranspose2d(4, 3, 3, stride=2), torch.randn(1, 4, 5, 5)),
        "groupnorm": (torch.nn.GroupNorm(2, 6), torch.randn(2, 6, 4, 4)),
        "layernorm": (torch.nn.LayerNorm(12), torch.randn(3, 12)),
        "rmsnorm": (torch.nn.RMSNorm(12, eps=1e-6), torch.randn(3, 12)),
        "embedding": (torch.nn.Embedding(20, 8), torch.tensor([[1, 5, 19]])),
    }


def randomize(layer: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p))


@pytest.mark.parametrize("name", list(make_layers()))
def test_converted_layers_compute_exactly_as_before_and_undo_restores_them(name):
    layer, x = make_layers()[name]
    randomize(layer)
    original_class, expected = type(layer), layer(x)
    signature = parameters_of(layer.forward)
    handle = ops.convert(layer)
    assert isinstance(layer, ops.CastLayer) and isinstance(layer, original_class)
    assert parameters_of(layer.forward)[: len(signature)] == signature
    assert torch.equal(layer(x), expected)  # not casting: the layer's own forward
    handle.undo()
    assert type(layer) is original_class and "comfy_cast_weights" not in layer.__dict__


@pytest.mark.parametrize("name", list(make_layers()))
@pytest.mark.parametrize("storage", [torch.float16, torch.bfloat16])
def test_storage_dtype_is_cast_to_the_input_dtype(name, storage):
    layer, x = make_layers()[name]
    randomize(layer)
    reference = make_layers()[name][0]
    reference.load_state_dict({k: v.to(storage).float() for k, v in layer.state_dict().items()})
    layer.to(storage)
    ops.convert(layer, cast=True)
    out = layer(x)
    assert out.dtype == (torch.float32 if name != "embedding" else storage)
    assert torch.equal(out.float(), reference(x).float())
    assert next(layer.parameters()).dtype == storage  # stored as it was: only the computation is in fp32


def test_weight_and_bias_functions_run_on_the_cast_copy():
    layer, x = make_layers()["linear"]
    randomize(layer)
    stored = layer.weight.detach().clone()
    ops.convert(layer)
    layer.weight_function = [lambda w: w * 2]
    layer.bias_function = [lambda b: b + 1]
    expected = torch.nn.functional.linear(x, stored * 2, layer.bias.detach() + 1)
    assert torch.equal(layer(x), expected)
    assert torch.equal(layer.weight, stored)  # the stored weight is untouched


def test_fp8_storage_with_a_per_tensor_scale():
    layer = torch.nn.Linear(32, 16)
    randomize(layer)
    x = torch.randn(4, 32)
    ops.convert(layer, cast=True)
    layer.weight.data = layer.weight.data.to(torch.float8_e4m3fn)
    layer.scale_weight = torch.nn.Parameter(torch.tensor(0.5), requires_grad=False)
    weight = layer.weight.to(torch.float32) * 0.5
    assert torch.allclose(layer(x), torch.nn.functional.linear(x, weight, layer.bias), atol=1e-5)


def test_a_converted_comfyui_style_layer_keeps_its_own_cast_flag():
    class AlwaysCast(torch.nn.Linear):
        comfy_cast_weights = True

    layer = AlwaysCast(4, 4)
    handle = ops.convert(layer)
    assert layer.comfy_cast_weights is True
    handle.undo()
    assert type(layer) is AlwaysCast and "comfy_cast_weights" not in layer.__dict__


def test_conversion_can_be_interrupted_and_leaves_nothing_half_done():
    tree = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(5)))

    def stop(done, total):
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ops.convert(tree, progress=stop)
    assert all(type(layer) is torch.nn.Linear for layer in tree)


def test_without_init_skips_initialisation():
    layer = ops.without_init(ops.Linear)(4, 4)
    assert isinstance(layer, ops.Linear)


def test_streamed_weights_on_a_simulated_gpu_are_counted_only_while_in_use():
    device = SimulatedDevice(64 * MiB)
    layer = torch.nn.Linear(512, 512)  # 1 MiB of fp32 weight, left in host memory
    ops.convert(layer, cast=True)
    x = device.place(torch.randn(2, 512))
    baseline = device.allocated()
    out = layer(x)
    assert isinstance(out, SimTensor) and out.sim_device is device
    assert device.peak_allocated() >= baseline + 512 * 512 * 4  # the cast weight was on the device during the op
    del out
    gc.collect()
    assert device.allocated() == baseline  # and is gone after it
    assert not isinstance(layer.weight, SimTensor)  # the stored weight never moved


def test_a_resident_weight_is_used_in_place_on_the_simulated_gpu():
    device = SimulatedDevice(64 * MiB)
    layer = torch.nn.Linear(64, 64)
    ops.convert(layer, cast=True)
    layer.weight = torch.nn.Parameter(device.place(layer.weight), requires_grad=False)
    layer.bias = torch.nn.Parameter(device.place(layer.bias), requires_grad=False)
    placed = device.allocated()
    device.reset_peak()
    layer(device.place(torch.randn(2, 64)))
    assert device.peak_allocated() < placed + 64 * 64 * 4  # no second copy of the weight
