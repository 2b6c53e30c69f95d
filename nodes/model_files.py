"""Which model files a loader node lists and which it takes: ComfyUI's folders (with the GGUF files it does not
list itself), the file's path when the prompt runs, and the refusals of a file the node cannot load, before
anything is read, naming what the file is and which node takes it.
"""

from __future__ import annotations

import os

from ..core.detection.detect import LLAMA_CPP_NAMED, Detection
from ..core.detection.headers import FileHeader
from ..core.errors import DeviceControlError, ModelFileError, UnknownModelError
from . import surface
from .bridge.comfy_detection import detect_with_comfyui

#: The node that loads a file of each kind.
LOADER_FOR = {
    "checkpoint": "Load Checkpoint With Device",
    "diffusion_model": "Load Diffusion Model With Device",
    "text_encoder": "Load Text Encoders With Device",
    "vae": "Load VAE With Device",
    "lora": "a LoRA loader (Load LoRA)",
}


def detection_for_this_comfyui(header: FileHeader, detection: Detection) -> Detection:
    """Our detection, or the running ComfyUI's own where ours names no class it builds.

    Our table follows the newest ComfyUI tested: a file it does not know may be of a family the user's ComfyUI
    knows (a newer one), and a class it names may be newer than the user's ComfyUI (which then builds the file as
    an older class, or not at all). Either way, what ComfyUI will build is what it detects.
    """
    if detection.kind == "unknown" or (
        detection.comfy_class is not None and not surface.has_model_class(detection.comfy_class)
    ):
        return detect_with_comfyui(header) or detection
    return detection


def require_kind(name: str, detection: Detection, kind: str, what: str, stock_loader: str) -> None:
    """Refuse, before anything is read, a file that is not of ``kind`` (``what``: how the node calls that kind),
    of no family ComfyUI can build, or with layers we cannot stream (which ``stock_loader`` loads), naming what the
    file is and which node takes it."""
    if detection.kind == "unknown":
        closest = "; ".join(detection.candidates[:3])
        raise UnknownModelError(
            f"{name} is not a model family ComfyUI can build (neither our header rules nor ComfyUI's own "
            f"detection recognise it): {detection.reason}."
            + (f" Closest: {closest}." if closest else "")
            + f" Check that the file is a complete {what}."
        )
    scaled = any(variant.startswith("scaled fp8") for variant in detection.variants)
    if "mixed-precision quantized layers" in detection.variants or (scaled and quantizes_scaled_fp8()):
        raise quantized_refusal(name, stock_loader)
    if detection.kind != kind:
        loader = LOADER_FOR.get(detection.kind, "the matching loader")
        if detection.file_format == "gguf" and not reads_gguf(detection):
            loader = f"a GGUF loader pack ({GGUF_READ}), or its safetensors with {loader}"
        raise DeviceControlError(
            f"{name} is a {detection.kind.replace('_', ' ')} ({detection.family}), not a {what}; load it with {loader}."
        )


#: The kinds whose Device Control loader reads GGUF files.
READS_GGUF = frozenset({"diffusion_model", "text_encoder"})


#: What Device Control reads of GGUF files, as the refusals say it.
GGUF_READ = (
    "Device Control reads GGUF diffusion models, and T5, UMT5 and Qwen3 text encoders in llama.cpp's names, so far"
)


def reads_gguf(detection: Detection) -> bool:
    """Whether a Device Control loader reads this GGUF file: a kind it loads, with ComfyUI's tensor names (a text
    encoder of an architecture ``core.detection.gguf_names`` does not map keeps llama.cpp's)."""
    return detection.kind in READS_GGUF and LLAMA_CPP_NAMED not in (detection.family or "")


def gguf_blocks(detection: Detection) -> str | None:
    """``GGUF Q8_0 blocks``: how a GGUF file's weights are kept (``None`` for another format)."""
    if detection.file_format != "gguf":
        return None
    kinds = {kind for c in detection.components for kind in c.stored_dtypes if kind not in ("F32", "F16", "BF16")}
    return f"GGUF {'/'.join(sorted(kinds)) or 'F16/F32'} blocks"


def refuse_unmapped_gguf(name: str, detection: Detection) -> None:
    """Refuse a GGUF file no loader of ours reads (a text encoder with llama.cpp's names), saying what takes it."""
    if detection.file_format == "gguf" and not reads_gguf(detection):
        raise DeviceControlError(
            f"{name} is a GGUF {detection.kind.replace('_', ' ')} ({detection.family}) that Device Control does not "
            f"read ({GGUF_READ}); load it with a GGUF loader pack, or load its safetensors file here."
        )


def quantizes_scaled_fp8() -> bool:
    """Whether the running ComfyUI turns scaled-fp8 files into its quantized layers while reading them (0.2x)."""
    return surface.old_quants_converter() is not None


def quantized_refusal(name: str, stock_loader: str) -> DeviceControlError:
    """The refusal of a file whose layers the running ComfyUI quantizes while reading them (``stock_loader``: the
    ComfyUI loader that takes it)."""
    return DeviceControlError(
        f"{name} stores its layers in fp8 with scales, which this ComfyUI ({surface.comfyui_version()}) turns into "
        "its quantized layers while reading them; Device Control cannot stream those yet. Load it with ComfyUI's "
        f"{stock_loader}, or use the fp16/bf16 file with an fp8 dtype here."
    )


def model_files(folder: str, *, gguf: bool = False) -> list[str]:
    """ComfyUI's list of ``folder``'s model files, with the folder's GGUF files where the node reads them
    (``gguf``): ComfyUI lists only the formats it loads itself."""
    folders = surface.folder_paths()
    names = set(folders.get_filename_list(folder))
    if gguf:
        for root in folders.get_folder_paths(folder):
            for directory, _subdirectories, files in os.walk(root, followlinks=True):
                names.update(os.path.relpath(os.path.join(directory, f), root) for f in files if is_gguf(f))
    return sorted(names)


def is_gguf(name: str) -> bool:
    """Whether ``name`` is a GGUF file's (by its extension, as ComfyUI tells formats apart)."""
    return name.lower().endswith(".gguf")


def model_path(folder: str, name: str, what: str, option: str) -> str:
    """The file ``name`` of ComfyUI's ``folder`` now; a clear error if it left the folder after the prompt was
    queued (``what``: how to call the file; ``option``: the node's input that names it)."""
    path = surface.folder_paths().get_full_path(folder, name)
    if path is None or not os.path.isfile(path):
        raise ModelFileError(
            f"{what} {name!r} is not in the {folder} folder any more (deleted or moved after the prompt was "
            f"queued). Put it back, or choose another in {option}, and queue the prompt again."
        )
    return path
