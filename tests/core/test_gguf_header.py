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
from core.detection.gguf_header import ORIG_SHAPE
from core.detection.headers import FileHeader, TensorInfo, read_header
from core.errors import ModelFileError
from tools.gguf_tokenizers import add_tokenizer
from tools.layouts import layouts

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
    (``tools.gguf_tokenizers.llama_cpp_tokenizer``'s metadata) where given."""
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


def test_a_shape_of_more_than_four_dimensions_comes_from_the_converters_record(tmp_path):
    tensors = {"patch.weight": ([16 * 4 * 2 * 3 * 3], Q.F16)}
    path = write_sparse_gguf(tensors, tmp_path / "wan.gguf", "wan", **{ORIG_SHAPE + "patch.weight": [16, 4, 2, 3, 3]})
    assert read_header(path, gguf=True).tensors["patch.weight"].shape == (16, 4, 2, 3, 3)


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
        ({"tensors": (("a", (1, 1, 1, 1, 1), 0, 0),)}, r"tensor 'a' has 5 dimensions; GGUF allows 4"),
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
