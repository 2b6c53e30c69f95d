"""What a ControlNet, CLIP vision model, model patch or upscale model file is, from its header alone.

ComfyUI tells these formats apart by which tensor names a file holds, in a fixed order (``comfy.controlnet``'s
``load_controlnet_state_dict``, ``comfy.clip_vision.load``, ``ModelPatchLoader``); the tables here follow that
order, as of the newest ComfyUI tested, so a loader can say what a file is, and refuse one of another kind with
the node that takes it, before a byte of weights is read. An upscale model is any of spandrel's many
architectures: only the commonest are named, and a file is refused as one only where it is positively another
kind (spandrel's own check decides the rest).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .detect import detect_header
from .headers import FileHeader, TensorInfo

#: The kinds of file this module tells apart, as the loaders name them.
MODEL_TYPE_NOUNS = {
    "controlnet": "ControlNet",
    "clip_vision": "CLIP vision model",
    "model_patch": "model patch",
    "upscale_model": "upscale model",
}


@dataclass(frozen=True)
class ModelType:
    """What a file is: its ``kind`` (one of :data:`MODEL_TYPE_NOUNS`, or a kind of ``detect``: ``checkpoint``,
    ``lora``, ..., or ``unknown``), its format and family as a user reads them, and for a ControlNet whether it is
    a difference ControlNet (added to the diffusion model it was trained from, which the loader then needs) and
    whether ComfyUI gives it a patcher a device can be chosen for (a T2I-Adapter it moves itself at each use)."""

    kind: str
    format: str
    bytes: int = 0
    difference: bool = False
    placeable: bool = True

    @property
    def noun(self) -> str:
        """``ControlNet``, ``CLIP vision model``; another kind by its name (``checkpoint``, ``lora``)."""
        return MODEL_TYPE_NOUNS.get(self.kind, self.kind.replace("_", " "))


Tensors = Mapping[str, TensorInfo]


def _context_family(tensors: Tensors, prefix: str) -> str:
    """The UNet family an ldm ControlNet serves, by its cross-attention's context width (and SDXL's class
    embedding): ComfyUI reads the same shapes to build it."""
    widths = {info.shape[1] for name, info in tensors.items() if name.endswith("attn2.to_k.weight") and info.shape}
    if f"{prefix}label_emb.0.0.weight" in tensors or 2048 in widths:
        return "SDXL"
    if 1024 in widths:
        return "SD2.x"
    if 768 in widths:
        return "SD1.x"
    return "unknown UNet"


def _mmdit_controlnet(tensors: Tensors) -> str | None:
    """The transformer ControlNets ComfyUI tells apart once ``controlnet_blocks.0.weight`` is there."""
    if "double_blocks.0.img_attn.norm.key_norm.scale" in tensors:
        return "Flux ControlNet (XLabs)"
    if "pos_embed_input.proj.weight" in tensors:
        if "transformer_blocks.0.adaLN_modulation.1.bias" in tensors:
            return "SD3.5 ControlNet (Stability)"
        return "SD3 ControlNet (diffusers)"
    if "transformer_blocks.0.img_mlp.net.0.proj.weight" in tensors:
        return "Qwen-Image ControlNet (InstantX)"
    if "controlnet_x_embedder.weight" in tensors:
        return "Flux ControlNet (InstantX, union)"
    return None


def _t2i_adapter(tensors: Tensors) -> str | None:
    names = {name.removeprefix("adapter.") for name in tensors}
    if "body.0.in_conv.weight" in names:
        return "T2I-Adapter (light)"
    if "conv_in.weight" in names and "body.0.block2.weight" in names:
        return "T2I-Adapter"
    if "body.0.resnets.0.block1.weight" in names:
        return "T2I-Adapter (diffusers)"
    if "backbone.0.0.weight" in tensors or "backbone.10.blocks.0.weight" in tensors:
        return "Stable Cascade ControlNet"
    return None


def _has(*names: str) -> Callable[[Tensors], bool]:
    return lambda tensors: all(name in tensors for name in names)


def _named(name: str) -> Callable[[Tensors], str]:
    return lambda _tensors: name


def _diffusers_controlnet(tensors: Tensors) -> str:
    union = " (union)" if "control_add_embedding.linear_1.bias" in tensors else ""
    family = "SDXL" if "add_embedding.linear_1.weight" in tensors else "SD1.x/SD2.x"
    return f"diffusers ControlNet{union}, {family}"


#: ControlNet formats in ComfyUI's order of checks: a test on the names and the format's name. (A file with
#: ``controlnet_blocks.0.weight`` and none of the transformer formats goes on to the next checks, as in ComfyUI.)
CONTROLNETS: tuple[tuple[Callable[[Tensors], bool], Callable[[Tensors], str]], ...] = (
    (_has("after_proj_list.18.bias"), _named("HunyuanDiT ControlNet")),
    (_has("lora_controlnet"), _named("Control-LoRA")),
    (_has("controlnet_cond_embedding.conv_in.weight"), _diffusers_controlnet),
    (lambda t: "controlnet_blocks.0.weight" in t and _mmdit_controlnet(t) is not None, _mmdit_controlnet),
    (_has("control_blocks.0.after_proj.weight", "control_img_in.weight"), _named("Qwen-Image ControlNet (VideoX-Fun)")),
    (_has("controlnet_blocks.0.linear.weight"), _named("Flux ControlNet (MistoLine)")),
    (_has("control_model.zero_convs.0.0.weight"), lambda t: f"ControlNet, {_context_family(t, 'control_model.')}"),
    (_has("zero_convs.0.0.weight"), lambda t: f"ControlNet, {_context_family(t, '')}"),
)


def controlnet_type(tensors: Tensors) -> ModelType | None:
    """The ControlNet a file holds, in ComfyUI's order of checks; ``None`` for a file that is none. A T2I-Adapter
    (ComfyUI's last try) is one ComfyUI moves to its device itself at each use: not placeable."""
    size = sum(info.nbytes for info in tensors.values())
    for holds, name in CONTROLNETS:
        if holds(tensors):
            return ModelType("controlnet", name(tensors), size, difference="difference" in tensors)
    adapter = _t2i_adapter(tensors)
    return ModelType("controlnet", adapter, size, placeable=False) if adapter else None


_LAYER = "vision_model.encoder.layers.{}.layer_norm1.weight"
#: CLIP vision formats in ComfyUI's order of checks (``comfy.clip_vision``), as for :data:`CONTROLNETS`.
CLIP_VISIONS: tuple[tuple[Callable[[Tensors], bool], Callable[[Tensors], str]], ...] = (
    (_has("visual.transformer.resblocks.0.attn.in_proj_weight"), lambda t: _open_clip(t)),
    (_has(_LAYER.format(47)), _named("CLIP vision ViT-bigG")),
    (_has(_LAYER.format(30)), _named("CLIP vision ViT-H")),
    (_has(_LAYER.format(22)), lambda t: _vit_l_or_siglip(t)),
    (_has("encoder.layer.39.layer_scale2.lambda1"), _named("DINOv2 giant")),
    (_has("encoder.layer.23.layer_scale2.lambda1"), _named("DINOv2 large")),
    (_has("layer.0.mlp.gate_proj.weight", "layer.31.norm1.weight"), _named("DINOv3 ViT-H+")),
)


def clip_vision_type(tensors: Tensors) -> ModelType | None:
    """The image encoder a CLIP vision file holds (OpenCLIP's ``visual.`` names as ComfyUI converts them)."""
    for holds, name in CLIP_VISIONS:
        if holds(tensors):
            return ModelType("clip_vision", name(tensors), sum(info.nbytes for info in tensors.values()))
    return None


def _open_clip(tensors: Tensors) -> str:
    """A file in OpenCLIP's names, by its layer count, as ComfyUI's conversion to its names keeps them."""
    layers = sum(1 for name in tensors if name.endswith(".attn.in_proj_weight"))
    size = "ViT-bigG" if layers >= 48 else "ViT-H" if layers >= 31 else "ViT-L" if layers >= 23 else "(too few layers)"
    return f"CLIP vision {size} (OpenCLIP names)"


def _vit_l_or_siglip(tensors: Tensors) -> str:
    width = tensors["vision_model.encoder.layers.0.layer_norm1.weight"].shape[0]
    positions = tensors.get("vision_model.embeddings.position_embedding.weight")
    count = positions.shape[0] if positions is not None and positions.shape else 0
    if width == 1152:
        patches = tensors.get("vision_model.embeddings.patch_embedding.weight")
        if patches is not None and len(patches.shape) == 2:
            return "SigLIP2 NaFlex"
        return f"SigLIP {384 if count == 729 else 512 if count == 1024 else '(unknown size)'}"
    if count == 577:
        return "CLIP vision ViT-L/336" + (" (LLaVA)" if "multi_modal_projector.linear_1.bias" in tensors else "")
    return "CLIP vision ViT-L"


#: Model patches as ComfyUI's ModelPatchLoader tells them apart: a tensor each holds, and its name.
MODEL_PATCHES: tuple[tuple[Callable[[Tensors], bool], str], ...] = (
    (lambda t: "lllite_conditioning1.conv1.weight" in t, "Anima ControlNet-LLLite"),
    (lambda t: "controlnet_blocks.0.y_rms.weight" in t, "Qwen-Image block-wise ControlNet (DiffSynth)"),
    (lambda t: "feature_embedder.mid_layer_norm.bias" in t, "USO style projector (SigLIP features)"),
    (lambda t: "control_all_x_embedder.2-1.weight" in t, "Z-Image Fun ControlNet"),
    (lambda t: "controlnet_patch_embedding.weight" in t, "Wan Uni3C ControlNet"),
    (lambda t: any(n.endswith("attention_pooler.query_tokens") for n in t), "LTX duration head"),
    (lambda t: "audio_proj.proj1.weight" in t, "audio projector"),
)


def model_patch_type(tensors: Tensors) -> ModelType | None:
    """The model patch a file holds (a kind ComfyUI's ModelPatchLoader builds)."""
    for holds, name in MODEL_PATCHES:
        if holds(tensors):
            return ModelType("model_patch", name, sum(info.nbytes for info in tensors.values()))
    return None


#: Upscale architectures named by a tensor each holds (spandrel reads many more; these are the commonest).
UPSCALERS = (
    ("model.1.sub.0.RDB1.conv1.0.weight", "ESRGAN (RRDBNet, old names)"),
    ("conv_first.weight", "ESRGAN (RRDBNet)"),
    ("body.0.rdb1.conv1.weight", "ESRGAN (RRDBNet)"),
    ("layers.0.residual_group.blocks.0.norm1.weight", "SwinIR"),
    ("module.layers.0.residual_group.blocks.0.norm1.weight", "SwinIR"),
    ("body.0.weight", "Real-ESRGAN Compact (SRVGGNet)"),
)


def upscale_type(tensors: Tensors) -> ModelType | None:
    """The upscale architecture a file holds, where it is one of :data:`UPSCALERS`."""
    for key, name in UPSCALERS:
        if key in tensors:
            return ModelType("upscale_model", name, sum(info.nbytes for info in tensors.values()))
    return None


#: Each kind's table, in the order a file of unknown kind is tried (the upscale names last: the loosest).
TABLES = {
    "controlnet": controlnet_type,
    "clip_vision": clip_vision_type,
    "model_patch": model_patch_type,
    "upscale_model": upscale_type,
}


def detect_model_type(header: FileHeader, wanted: str) -> ModelType:
    """What the file is, tried first as ``wanted`` (one of :data:`MODEL_TYPE_NOUNS`), then as each other kind:
    the model types here, then what ``detect`` knows (a checkpoint, a diffusion model, a LoRA, ...). A file
    none of them names is ``unknown`` (which, for an upscale model, spandrel may still read)."""
    tensors = header.tensors
    size = sum(info.nbytes for info in tensors.values())
    for kind in (wanted, *(k for k in TABLES if k != wanted)):
        found = TABLES[kind](tensors)
        if found is not None:
            return found
    other = detect_header(header)
    if other.kind != "unknown":
        return ModelType(other.kind, other.family or other.kind, size)
    return ModelType("unknown", "no format this loader or ComfyUI's tells apart", size)
