"""Cast layers against ComfyUI's own: every layer type and dtype pair computes what ``comfy.ops.manual_cast``
computes, bit for bit, with and without weight functions, built fresh or converted from ComfyUI's layer."""

from __future__ import annotations

import importlib

import pytest
import torch

from core.devices.sim.device import SimulatedDevice
from core.devices.slices import RowSlices, row_geometry
from core.devices.transfer import GROUPED
from core.placement.engine import partial_model_of
from core.placement.plan import Layer
from core.placement.streaming import NO_HOOKS, reset_flags, stream
from core.weights import ops

STORAGE = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.fixture(scope="module")
def manual_cast(comfy_runtime):
    from tools.runtime.inprocess import import_comfy

    import_comfy()
    return importlib.import_module("comfy.ops").manual_cast


def layer_specs():
    torch.manual_seed(5)
    return {
        "Linear": ((16, 8), torch.randn(3, 16)),
        "Conv1d": ((4, 6, 3), torch.randn(2, 4, 10)),
        "Conv2d": ((4, 6, 3), torch.randn(2, 4, 8, 8)),
        "Conv3d": ((2, 3, 3), torch.randn(1, 2, 5, 5, 5)),
        "ConvTranspose1d": ((4, 3, 3), torch.randn(2, 4, 7)),
        "ConvTranspose2d": ((4, 3, 3), torch.randn(1, 4, 5, 5)),
        "GroupNorm": ((2, 6), torch.randn(2, 6, 4, 4)),
        "LayerNorm": ((12,), torch.randn(3, 12)),
        "RMSNorm": ((12,), torch.randn(3, 12)),
        "Embedding": ((20, 8), torch.tensor([[1, 5, 19]])),
    }


def twin(manual_cast, name, args, storage):
    """ComfyUI's manual_cast layer and ours, with the same weights in ``storage``."""
    theirs = getattr(manual_cast, name)(*args, dtype=storage)
    ours = ops.without_init(getattr(ops, name))(*args, dtype=storage)  # fp8 layers cannot be initialised
    with torch.no_grad():
        for (_key, mine), (_, reference) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
            value = (torch.randn(mine.shape) * 0.5).to(storage)
            mine.copy_(value)
            reference.copy_(value)
    ours.comfy_cast_weights = True
    return theirs, ours


@pytest.mark.parametrize("storage", STORAGE, ids=str)
@pytest.mark.parametrize("name", list(layer_specs()))
def test_cast_layers_equal_comfyui_manual_cast(manual_cast, name, storage):
    args, x = layer_specs()[name]
    theirs, ours = twin(manual_cast, name, args, storage)
    for compute in (torch.float32, torch.bfloat16):
        inputs = x if name == "Embedding" else x.to(compute)
        kwargs = {"out_dtype": compute} if name == "Embedding" else {}
        expected, got = theirs(inputs, **kwargs), ours(inputs, **kwargs)
        assert got.dtype == expected.dtype and torch.equal(got, expected), (name, storage, compute)
    # weight functions run on the cast copy, after the cast, as in ComfyUI
    theirs.weight_function = ours.weight_function = [lambda w: w * 0.5 + 1]
    inputs = x if name == "Embedding" else x.float()
    kwargs = {"out_dtype": torch.float32} if name == "Embedding" else {}
    assert torch.equal(ours(inputs, **kwargs), theirs(inputs, **kwargs))


@pytest.mark.parametrize("name", list(layer_specs()))
def test_a_converted_comfyui_layer_computes_as_before(manual_cast, name):
    args, x = layer_specs()[name]
    theirs, _ = twin(manual_cast, name, args, torch.float16)
    inputs = x if name == "Embedding" else x.float()
    expected = theirs(inputs)
    handle = ops.convert(theirs)
    assert isinstance(theirs, ops.CastLayer) and theirs.comfy_cast_weights is True  # manual_cast's own flag kept
    assert torch.equal(theirs(inputs), expected)
    handle.undo()
    assert not isinstance(theirs, ops.CastLayer)


@pytest.fixture(scope="module")
def comfy_ops(manual_cast):
    """ComfyUI's ops, and the standard layer classes the pack's surface names (as ComfyUI loads the pack)."""
    from tools.runtime.inprocess import import_pack

    surface = importlib.import_module(f"{import_pack().__name__}.nodes.surface")
    return importlib.import_module("comfy.ops"), surface.standard_layer_classes()


SLICED = {"Linear": ((96, 256), torch.randn(2, 5, 96)), "Conv1d": ((8, 256, 3), torch.randn(2, 8, 9))}
SLICED["Conv2d"] = ((8, 256, 3), torch.randn(1, 8, 6, 6))


@pytest.mark.parametrize("storage", STORAGE[:4], ids=str)
@pytest.mark.parametrize("family", ["disable_weight_init", "manual_cast"])
@pytest.mark.parametrize("name", list(SLICED))
def test_comfyuis_standard_layers_converted_and_streamed_in_slices_compute_as_comfyui(comfy_ops, name, family, storage):
    """How Move To GPU gets a model from ComfyUI's own loader to stream in row slices: its standard layers become
    cast layers, and streamed in slices they compute bit for bit what ComfyUI's layer computes whole; undone,
    the layer is ComfyUI's again, with every attribute it had (ComfyUI 0.2x gives layers more of them)."""
    comfy, standard = comfy_ops
    args, x = SLICED[name]
    theirs = getattr(getattr(comfy, family), name)(*args, dtype=storage)
    with torch.no_grad():
        for parameter in theirs.parameters():
            parameter.copy_((torch.randn(parameter.shape) * 0.5).to(storage))
    theirs.comfy_cast_weights = True  # as ComfyUI streams it
    expected = theirs(x)
    attributes, cls = dict(theirs.__dict__), type(theirs)
    assert cls in standard
    handle = ops.convert(theirs, accept=lambda c: c in standard)
    assert len(handle.layers) == 1 and row_geometry(theirs) is not None
    device = SimulatedDevice(64 * 1024**2)
    layer = Layer("layer", theirs, 0, True)
    stream(layer, device, NO_HOOKS, RowSlices((0, 64, 192, 256)))
    with torch.no_grad():
        out = theirs(device.place(x))
    assert torch.equal(device.release(out).clone(), expected), (name, family, storage)
    reset_flags(layer)
    handle.undo()
    assert type(theirs) is cls and set(attributes) <= set(theirs.__dict__)
    assert set(theirs.__dict__) - set(attributes) <= {"weight_function", "bias_function"}  # emptied, as ComfyUI does


@pytest.mark.parametrize("storage", STORAGE[:3], ids=str)
@pytest.mark.parametrize("family", ["disable_weight_init", "manual_cast"])
def test_comfyuis_standard_layers_converted_and_streamed_through_a_ring_compute_as_comfyui(comfy_ops, family, storage):
    """How Move To GPU streams a model ComfyUI's own loader built: its standard layers (norms too) become cast
    layers, packed in groups into a ring's slabs, and computing from the ring's slots they give, bit for bit, what
    ComfyUI's own layers give streaming their way."""
    comfy, standard = comfy_ops
    kinds = getattr(comfy, family)
    torch.manual_seed(3)
    net = torch.nn.Sequential(
        kinds.Conv2d(4, 8, 3, padding=1, dtype=storage),
        kinds.GroupNorm(2, 8, dtype=storage),
        kinds.Conv2d(8, 8, 1, dtype=storage),
    )
    head = torch.nn.Sequential(kinds.Linear(8, 16, dtype=storage), kinds.LayerNorm(16, dtype=storage))
    with torch.no_grad():
        for parameter in [*net.parameters(), *head.parameters()]:
            parameter.copy_((torch.randn(parameter.shape) * 0.5).to(storage))
    for layer in [*net, *head]:
        layer.comfy_cast_weights = True  # as ComfyUI streams them
    x = torch.randn(1, 4, 5, 5)
    expected = head(net(x).mean(dim=(2, 3)))
    assert all(type(layer) in standard for layer in [*net, *head])
    model = torch.nn.ModuleDict({"net": net, "head": head})
    ops.convert(model, accept=lambda cls: cls in standard)
    device = SimulatedDevice(64 * 1024**2)
    engine = partial_model_of(model)
    engine.load(device, 0)  # everything streams
    assert all(GROUPED in layer.__dict__ for layer in [*net, *head])  # the norms too: they join the groups
    with torch.no_grad():
        out = head(net(device.place(x)).mean(dim=(2, 3)))
    assert torch.equal(device.release(out).clone(), expected), (family, storage)
    engine.unload_all()
