"""GGUF headers (``core.detection.gguf_header``) against the GGML project's own reader (``gguf.GGUFReader``), on
sparse files its writer made from real model layouts; detection of those files as the same family as their
safetensors twins; and the refusals a damaged or unreadable GGUF gets, before any tensor is read."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from core.detection.detect import detect, detect_header
from core.detection.ggml_types import FILE_TYPES, file_type_name, storage_label
from core.detection.gguf_header import ORIG_SHAPE
from core.detection.headers import FileHeader, TensorInfo, read_header
from core.errors import ModelFileError
from tools.fixtures.gguf_tokenizers import add_tokenizer
from tools.fixtures.layouts import layouts

LAYOUTS = layouts()
Q = gguf.GGMLQuantizationType


def quantised_type(shape: list[int]) -> Q:
    """The type a GGUF converter gives a tensor: K blocks where rows allow, Q8_0 else, vectors kept in F32."""
    if len(shape) < 2:
        return Q.F32
    if shape[-1] % 256 == 0:
        return Q.Q4_K
    return Q.Q8_0 if shape[-1] % 32 == 0 else Q.F16


def write_sparse_gguf(
    tensors: dict[str, tuple[list[int], Q]], path: Path, arch: str, tokenizer: dict | None = None, **arrays: list
) -> Path:
    """A GGUF file written by ``gguf``'s own writer whose data is a hole (no disk used), carrying ``tokenizer``
    (``tools.fixtures.gguf_tokenizers.llama_cpp_tokenizer``'s metadata) where given."""
    writer = gguf.GGUFWriter(str(path), arch)
    if tokenizer is not None:
        add_tokenizer(writer, tokenizer)
    for key, values in arrays.items():
        writer.add_array(key, values)
    end = 0
    for name, (shape, kind) in tensors.items():
        values, size = gguf.GGML_QUANT_SIZES[kind]
        row = shape[-1] // values * size if shape else size
        nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * row if shape else size
        writer.add_tensor_info(name, [*shape[:-1], row], np.dtype(np.uint8), nbytes, raw_dtype=kind)
        end += -(-nbytes // writer.data_alignment) * writer.data_alignment
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with open(path, "r+b") as handle:
        handle.seek(0, 2)
        start = -(-handle.tell() // writer.data_alignment) * writer.data_alignment
        handle.truncate(start + end)
    return path


#: The ``general.architecture`` ComfyUI's GGUF converters write for a layout.
ARCHITECTURES = {"flux1_dev.diffusion_model.json": "flux", "sd15.diffusion_model.json": "sd1"}


def gguf_of(layout: str, path: Path) -> Path:
    tensors = {name: (shape, quantised_type(shape)) for name, (shape, _) in LAYOUTS[layout]["tensors"].items()}
    return write_sparse_gguf(tensors, path, ARCHITECTURES[layout])


@pytest.mark.parametrize("layout", list(ARCHITECTURES))
def test_the_header_is_the_one_the_ggml_reader_reads(layout, tmp_path):
    path = gguf_of(layout, tmp_path / "model.gguf")
    ours = read_header(path, gguf=True)
    theirs = gguf.GGUFReader(path)
    assert ours.format == "gguf" and len(ours.tensors) == len(theirs.tensors) == len(LAYOUTS[layout]["tensors"])
    for tensor in theirs.tensors:
        info = ours.tensors[tensor.name]
        assert info.shape == tuple(int(d) for d in reversed(tensor.shape)), tensor.name
        assert info.dtype == tensor.tensor_type.name
        assert (ours.data_start + info.begin, info.nbytes) == (tensor.data_offset, tensor.n_bytes), tensor.name
    assert ours.metadata["general.architecture"] == ARCHITECTURES[layout]


@pytest.mark.parametrize("layout", list(ARCHITECTURES))
def test_a_gguf_is_detected_as_the_family_of_its_safetensors_twin(layout, tmp_path):
    found = detect(gguf_of(layout, tmp_path / "model.gguf"))
    tensors = {k: TensorInfo(k, dtype, tuple(shape)) for k, (shape, dtype) in LAYOUTS[layout]["tensors"].items()}
    twin = detect_header(FileHeader(layout, "safetensors", tensors))
    assert (found.kind, found.family, found.comfy_class) == (twin.kind, twin.family, twin.comfy_class)
    unet = found.component("diffusion_model")[0]
    assert "Q4_K" in unet.stored_dtypes and unet.parameter_count == twin.component("diffusion_model")[0].parameter_count
    quantised = 0  # its bytes in GGML's blocks, as gguf sizes them
    for shape, _ in LAYOUTS[layout]["tensors"].values():
        values, size = gguf.GGML_QUANT_SIZES[quantised_type(shape)]
        quantised += int(np.prod(shape, dtype=np.int64)) // values * size
    assert unet.stored_bytes == quantised < twin.component("diffusion_model")[0].stored_bytes
    # The fit plan's sizes: the blocks keep their bytes in any dtype chosen; F32 and F16 tensors are converted.
    plain = sum(int(np.prod(s)) for s, _ in LAYOUTS[layout]["tensors"].values() if quantised_type(s) in (Q.F32, Q.F16))
    blocks = quantised - sum(
        int(np.prod(s)) * gguf.GGML_QUANT_SIZES[quantised_type(s)][1]
        for s, _ in LAYOUTS[layout]["tensors"].values()
        if quantised_type(s) in (Q.F32, Q.F16)
    )
    assert (unet.bytes_by_dtype["fp16"], unet.bytes_by_dtype["fp32"]) == (blocks + 2 * plain, blocks + 4 * plain)


def test_the_loaders_refuse_a_gguf_saying_what_it_holds_and_what_loads_it(tmp_path):
    path = gguf_of("flux1_dev.diffusion_model.json", tmp_path / "flux.gguf")
    with pytest.raises(
        ModelFileError,
        match=r"flux.gguf is a GGUF file \(flux, 780 tensors in F32/Q4_K/Q8_0\).*Load Diffusion Model With Device",
    ):
        read_header(path)


def test_a_shape_the_converter_reshaped_comes_from_its_record(tmp_path):
    """ComfyUI-GGUF's converter stores an SD1.5 or SDXL tensor whose rows are not whole K blocks as rows of 256
    values, recording its shape under ``comfy.gguf.orig_shape.<name>`` (its ``tools/convert.py``)."""
    tensors = {"input_blocks.1.0.in_layers.2.weight": ([320 * 320 * 9 // 256, 256], Q.Q4_K)}
    shape = {ORIG_SHAPE + "input_blocks.1.0.in_layers.2.weight": [320, 320, 3, 3]}
    path = write_sparse_gguf(tensors, tmp_path / "sdxl.gguf", "sdxl", **shape)
    assert read_header(path, gguf=True).tensors["input_blocks.1.0.in_layers.2.weight"].shape == (320, 320, 3, 3)


def test_a_five_dimensional_tensor_as_comfyui_gguf_puts_it_back_is_read(tmp_path):
    """ComfyUI-GGUF's ``tools/fix_5d_tensors.py`` adds Wan's and Hunyuan Video's patch embedding to the quantised
    file as an F32 tensor of five dimensions (``gguf``'s writer writes any count; GGML's own reader allows four)."""
    writer = gguf.GGUFWriter(str(tmp_path / "wan.gguf"), "wan")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_tensor("patch_embedding.bias", np.zeros(64, np.float32))
    writer.add_tensor("patch_embedding.weight", np.ones((64, 16, 1, 2, 2), np.float32), raw_dtype=Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    header = read_header(tmp_path / "wan.gguf", gguf=True)
    theirs = {t.name: t for t in gguf.GGUFReader(tmp_path / "wan.gguf").tensors}
    info = header.tensors["patch_embedding.weight"]
    assert info.shape == (64, 16, 1, 2, 2) == tuple(int(d) for d in reversed(theirs[info.name].shape))
    assert (info.dtype, header.data_start + info.begin) == ("F32", theirs[info.name].data_offset)
    assert file_type_name(header.metadata) == "Q8_0"


def test_a_type_we_do_not_dequantise_is_refused_naming_the_tensor(tmp_path):
    path = write_sparse_gguf({"blk.0.weight": ([8, 256], Q.IQ2_XXS)}, tmp_path / "iq.gguf", "flux")
    with pytest.raises(ModelFileError, match=r"tensor 'blk.0.weight' of iq.gguf is stored in GGML type 16"):
        read_header(path, gguf=True)


def handmade(path: Path, version: int = 3, tensors: tuple = (), size: int | None = None) -> Path:
    """A GGUF written byte by byte, for what no writer produces: ``tensors`` as (name, dims, type, offset)."""
    raw = b"GGUF" + struct.pack("<IQQ", version, len(tensors), 0)
    for name, dims, kind, offset in tensors:
        raw += struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", len(dims))
        raw += struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", kind, offset)
    raw += b"\0" * (-len(raw) % 32)
    path.write_bytes(raw + b"\0" * ((size or 0) - len(raw) if size else 0))
    return path


@pytest.mark.parametrize(
    ("made", "problem"),
    [
        ({"version": 1}, r"it is GGUF version 1; Device Control reads versions 2 and 3"),
        ({"tensors": (("a", (32, 2), 0, 0), ("b", (32,), 0, 128)), "size": 4096}, r"tensors 'a' and 'b' overlap"),
        ({"tensors": (("a", (32, 2), 0, 0),), "size": 96}, r"tensor 'a' lies outside the file"),
        ({"tensors": (("a", (1,) * 65, 0, 0),)}, r"tensor 'a' claims 65 dimensions, more than a tensor can have"),
        ({"tensors": (("a", (33, 2), 8, 0),)}, r"tensor 'a' \(Q8_0, shape \(2, 33\)\) is not a whole number of blocks"),
    ],
)
def test_a_damaged_gguf_is_refused_naming_the_problem_and_the_fix(tmp_path, made, problem):
    path = handmade(tmp_path / "bad.gguf", **made)
    with pytest.raises(ModelFileError, match=problem + r".*download it again"):
        read_header(path, gguf=True)


def test_a_truncated_header_or_a_crafted_count_is_refused_before_anything_is_allocated(tmp_path):
    whole = handmade(tmp_path / "whole.gguf", tensors=(("a.weight", (32, 2), 0, 0),), size=4096).read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[:40])
    with pytest.raises(ModelFileError, match=r"the header runs past the end of the file"):
        read_header(tmp_path / "cut.gguf", gguf=True)
    (tmp_path / "count.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**62, 0) + b"\0" * 64)
    with pytest.raises(ModelFileError, match=r"claims 4611686018427387904 tensors"):
        read_header(tmp_path / "count.gguf", gguf=True)


def test_a_file_named_gguf_is_judged_as_one_and_a_safetensors_by_its_content(tmp_path):
    """A damaged ``.gguf`` is named a damaged GGUF (not a safetensors file whose header length runs past its end);
    a ``.safetensors`` file is judged by what it holds, so a GGUF saved under that name is still read as one."""
    from safetensors.numpy import save_file

    damaged = {"zeroed.gguf": b"\0" * 64, "page.gguf": b"<!DOCTYPE html><html></html>", "short.gguf": b"GG"}
    for name, raw in damaged.items():
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(ModelFileError, match=rf"{name} is not a valid GGUF file: .*download it again") as raised:
            read_header(tmp_path / name, gguf=True)
        assert "safetensors" not in str(raised.value)
    with pytest.raises(ModelFileError, match=r"its magic is b'<!DO', where a GGUF file starts with b'GGUF'"):
        read_header(tmp_path / "page.gguf")
    save_file({"w": np.zeros((2, 2), np.float32)}, str(tmp_path / "real.safetensors"))
    assert read_header(tmp_path / "real.safetensors").format == "safetensors"
    handmade(tmp_path / "gguf.safetensors", tensors=(("a.weight", (32, 2), 0, 0),), size=4096)
    assert read_header(tmp_path / "gguf.safetensors", gguf=True).format == "gguf"
    (tmp_path / "zeroed.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ModelFileError, match=r"not a valid safetensors file: its header length"):
        read_header(tmp_path / "zeroed.safetensors")


def test_the_file_types_are_llama_cpps():
    assert {n: f"MOSTLY_{name}" for n, name in FILE_TYPES.items() if n} == {
        t.value: t.name for t in gguf.LlamaFileType if t.value in FILE_TYPES and t.value
    }
    assert file_type_name({"general.file_type": "15"}) == "Q4_K_M"
    assert file_type_name({"general.file_type": 1024 + 7}) == "Q8_0"  # a type the converter guessed
    assert file_type_name({}) is file_type_name({"general.file_type": "x"}) is file_type_name({"general.file_type": 99})


@pytest.mark.parametrize(
    ("sizes", "file_type", "label"),
    [
        ({"Q4_K": 50, "Q6_K": 30, "bfloat16": 40, "float32": 10}, "Q4_K_M", "Q4_K_M: Q4_K/Q6_K blocks, BF16/F32 plain"),
        ({"float32": 90, "Q6_K": 30, "Q4_K": 50, "F32": 5}, None, "Q4_K/Q6_K blocks, F32 plain"),
        ({"Q8_0": 10, "float32": 90}, "Q8_0", "Q8_0"),
        ({"Q8_0": 10, "float16": 90}, None, "Q8_0"),
        ({"Q4_K": 10}, "Q4_K_S", "Q4_K_S: Q4_K blocks"),
        ({"float32": 10, "F16": 4}, "F16", None),
    ],
)
def test_a_gguf_model_is_named_by_its_file_type_then_its_block_types_then_its_plain_ones(sizes, file_type, label):
    assert storage_label(sizes, file_type) == label
