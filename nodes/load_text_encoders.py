"""Load Text Encoders With Device: one to four text-encoder files as a CLIP, on the device and in the dtype chosen.

One node for what ComfyUI's Load CLIP, DualCLIPLoader, TripleCLIPLoader and QuadrupleCLIPLoader do: the ``type``
options are the running ComfyUI's own. The node reads every header first (what each file is, its size), refuses
a file that is not a text encoder or a set of files the type does not take, plans the fit and checks RAM before
reading a byte of weights, then builds the CLIP with ComfyUI's classes, as its loaders do, and streams the
weights into place (``bridge.text_encoders``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..core.detection.detect import Detection, detect_header
from ..core.detection.gguf_tokenizer import SPIECE_MODEL, carries_unigram_tokenizer, tokenizer_from_weights
from ..core.detection.headers import FileHeader, read_header
from ..core.detection.text_encoder_types import check_type
from ..core.errors import DeviceControlError
from ..core.placement.fit import Choice, FitPlan
from ..core.units import format_bytes
from . import surface
from .bridge.comfy_detection import COMFY_DETECTED, text_encoder_with_comfyui
from .bridge.storage import storage_bytes
from .bridge.text_encoders import build_text_encoders
from .model_files import (
    gguf_blocks,
    model_files,
    model_path,
    quantized_refusal,
    quantizes_scaled_fp8,
    refuse_unmapped_gguf,
    require_kind,
)
from .placing import (
    check_devices,
    device_input,
    dtype_input,
    loaded,
    plan_load,
    progress_bar,
    resolve_placement,
    summary_output,
    with_fit,
)
from .state import inventory

ROLE = "text_encoder"
#: A key ComfyUI's older scaled-fp8 files carry (the layers' scales sit beside their weights).
SCALED_FP8 = "scaled_fp8"
#: The metadata entry of ComfyUI's newer mixed-precision quantized files.
QUANTIZED = "_quantization_metadata"
#: What an optional file input holds when it is not used.
NONE = "none"
FILE_INPUTS = ("clip_name1", "clip_name2", "clip_name3", "clip_name4")


class LoadTextEncodersWithDevice(surface.io.ComfyNode):
    """Thin node: detection, fit and building live in ``core`` and ``bridge``."""

    @classmethod
    def define_schema(cls) -> Any:
        io = surface.io
        files = model_files("text_encoders", gguf=True)
        file_tooltip = (
            "A text-encoder file (from ComfyUI's text_encoders folders, clip included): safetensors, or a T5, UMT5 or "
            "Qwen3 GGUF (kept quantised, dequantised layer by layer as it computes)"
        )
        return io.Schema(
            node_id="DeviceControl_LoadTextEncoders",
            display_name="Load Text Encoders With Device",
            category="Device Control",
            description=(
                "Loads one to four text-encoder files (CLIP-L, CLIP-G, T5-XXL, UMT5, LLM encoders ...) as the text "
                "encoder of the type you choose, on the device and in the dtype you choose: what ComfyUI's Load CLIP "
                "and its Dual, Triple and Quadruple loaders do, in one node. Reads the headers first: what each file "
                "is, whether the type takes it and whether it fits are known before any weight is read."
            ),
            inputs=[
                io.Combo.Input("clip_name1", options=files, tooltip=f"{file_tooltip}."),
                *(
                    io.Combo.Input(name, options=[NONE, *files], default=NONE, tooltip=f"{file_tooltip}, or none.")
                    for name in FILE_INPUTS[1:]
                ),
                io.Combo.Input(
                    "type",
                    options=surface.clip_types(),
                    default="stable_diffusion",
                    tooltip=(
                        "The model the text encoders are for, as ComfyUI's CLIP loaders name it: stable_diffusion "
                        "(CLIP-L), sdxl (CLIP-L + CLIP-G), sd3 (any of CLIP-L, CLIP-G, T5-XXL), flux (CLIP-L + "
                        "T5-XXL), wan (UMT5-XXL), chroma (T5-XXL), hidream (up to four) ..."
                    ),
                ),
                device_input("device", "text encoders"),
                dtype_input("dtype", "text encoders"),
            ],
            hidden=[io.Hidden.unique_id],
            outputs=[
                io.Clip.Output(tooltip="The text encoders, for CLIP Text Encode and the like."),
                summary_output(),
            ],
        )

    @classmethod
    def validate_inputs(cls, device: str) -> bool | str:
        return check_devices("Load Text Encoders With Device", cls, device=device)

    @classmethod
    def execute(
        cls,
        clip_name1: str,
        clip_name2: str,
        clip_name3: str,
        clip_name4: str,
        type: str,  # the input's name, as ComfyUI's CLIP loaders call it
        device: str,
        dtype: str,
    ) -> Any:
        names, headers = _files(clip_name1, clip_name2, clip_name3, clip_name4)
        detections = [_text_encoder(name, header) for name, header in zip(names, headers, strict=True)]
        _require_type(type, names, detections)
        notes: list[str] = []
        place, choice = resolve_placement(ROLE, device, dtype, detections[0], inventory.snapshot(), notes)
        components = [
            dataclasses.replace(d.components[0], name=f"{ROLE}:{d.family}") for d in detections if d.components
        ]
        plan = plan_load(" + ".join(names), components, {ROLE: choice}, notes, cls)
        built = build_text_encoders(headers, type, with_fit(place, plan, choice), progress_bar())
        return loaded(cls, _summary(type, names, detections, choice, plan, built.clip, notes + built.notes), built.clip)


def _files(*chosen: str) -> tuple[list[str], list[FileHeader]]:
    """The files chosen (``none`` skipped) and their headers."""
    pairs = [(name, option) for name, option in zip(chosen, FILE_INPUTS, strict=True) if name and name != NONE]
    paths = [model_path("text_encoders", name, "text encoder", option) for name, option in pairs]
    return [name for name, _ in pairs], [read_header(path, gguf=True) for path in paths]


def _text_encoder(name: str, header: FileHeader) -> Detection:
    """What the file is, refused unless it is a text encoder our rules or the running ComfyUI recognise, and one
    whose weights can stream (not layers the running ComfyUI quantizes while reading them)."""
    detection = detect_header(header)
    if detection.kind == "unknown":
        detection = text_encoder_with_comfyui(header) or detection
    require_kind(name, detection, ROLE, "text encoder", "Load CLIP")
    refuse_unmapped_gguf(name, detection)
    if header.format == "gguf" and tokenizer_from_weights(header) and not carries_unigram_tokenizer(header.metadata):
        raise DeviceControlError(
            f"{name} is a GGUF {detection.family} without its tokenizer: ComfyUI builds this encoder's tokenizer "
            f"from its weights file ({SPIECE_MODEL} in a safetensors file, tokenizer.ggml.* metadata in a GGUF "
            "written by llama.cpp's converter), and this file has neither. Load its safetensors file, or a GGUF "
            "converted with its tokenizer."
        )
    if quantizes_scaled_fp8() and (SCALED_FP8 in header.tensors or QUANTIZED in header.metadata):
        raise quantized_refusal(name, "Load CLIP (or its Dual/Triple/Quadruple loader)")
    return detection


def _require_type(clip_type: str, names: list[str], detections: list[Detection]) -> None:
    """Refuse a set of files the type does not take (where every file's encoder is one our recipes name)."""
    if any(COMFY_DETECTED in (d.family or "") for d in detections):
        return  # an encoder only the running ComfyUI knows: its loader decides what it takes
    check = check_type(clip_type, [d.family or "" for d in detections], surface.clip_types())
    if check.problem is None:
        return
    files = ", ".join(f"{name} is {d.family}" for name, d in zip(names, detections, strict=True))
    fix = (
        f"choose the type {' or '.join(check.suits)}" if check.suits else "no type takes these files together"
    ) + ", or give the files the type takes"
    raise DeviceControlError(f"Load Text Encoders With Device: {check.problem} ({files}). To fix it, {fix}.")


def _summary(
    clip_type: str,
    names: list[str],
    detections: list[Detection],
    choice: Choice,
    plan: FitPlan,
    clip: Any,
    notes: list[str],
) -> str:
    encoders = " + ".join(f"{d.family} ({name})" for name, d in zip(names, detections, strict=True))
    stored = _floats(clip)  # a GGUF's uint8 blocks left out, beside safetensors files too
    lines = [f"{clip_type} text encoders: {encoders}, as {type(clip.cond_stage_model).__name__}"]
    blocks = [gguf_blocks(d) for d in detections if d.components]  # one per planned part, in order
    lines += [
        f"  text encoder {part.component.split(':', 1)[1]}: {choice.device.id} ({choice.device.name}), "
        f"{f'{kept}, the rest {stored}' if kept else stored}: {format_bytes(part.bytes)} planned"
        for part, kept in zip(plan.components, blocks, strict=True)
    ]
    lines += [f"  fit on {d.device}: {d.verdict}" for d in plan.devices]
    lines += [f"  warning: {note}" for note in notes]
    return "\n".join(lines)


def _floats(clip: Any) -> str:
    """How most of the text encoders' floating-point weights are stored (beside a GGUF's blocks)."""
    sizes = {k: n for k, n in storage_bytes(clip.cond_stage_model).items() if k.startswith(("float", "bfloat"))}
    return max(sizes, key=sizes.__getitem__) if sizes else "none"
