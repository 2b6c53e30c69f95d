"""Reading model files: valid safetensors and pickles, and every kind of broken file, each refused with a
message that names the file, the problem and the fix."""

from __future__ import annotations

import json
import os
import pickle
import struct

import pytest
import torch
from safetensors.torch import save_file

from core.detection.headers import read_header
from core.errors import ModelFileError, UnsafePickleError
from core.files.reader import WeightReader


def raw_safetensors(path, header: dict, data: bytes = b"", header_len: int | None = None):
    raw = json.dumps(header).encode()
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw) if header_len is None else header_len))
        handle.write(raw)
        handle.write(data)
    return path


@pytest.fixture
def good(tmp_path):
    tensors = {"a.weight": torch.randn(4, 3), "b.bias": torch.arange(5, dtype=torch.int64), "c": torch.tensor(2.5)}
    path = tmp_path / "good.safetensors"
    save_file(tensors, str(path), metadata={"family": "test"})
    return path, tensors


def test_a_valid_file_gives_names_shapes_dtypes_offsets_and_metadata(good):
    path, _tensors = good
    header = read_header(path)
    assert header.format == "safetensors" and header.metadata == {"family": "test"}
    assert header.tensors["a.weight"].shape == (4, 3) and header.tensors["a.weight"].dtype == "F32"
    assert header.tensors["b.bias"].dtype == "I64" and not header.tensors["b.bias"].is_float
    assert header.tensors["c"].shape == () and header.tensors["c"].nbytes == 4
    assert header.data_start + sum(t.nbytes for t in header.tensors.values()) == header.file_size


def test_the_reader_fills_tensors_of_any_dtype_exactly(good):
    path, tensors = good
    with WeightReader(read_header(path)) as reader:
        for name, expected in tensors.items():
            assert torch.equal(reader.read(name), expected)
        into = torch.empty(4, 3, dtype=torch.float16)
        reader.read_into("a.weight", into)  # converted through the staging buffer
        assert torch.equal(into, tensors["a.weight"].half())
        with pytest.raises(ModelFileError, match=r"has shape \[4, 3\], but the model expects \[5\]"):
            reader.read_into("a.weight", torch.empty(5))
        with pytest.raises(ModelFileError, match="has no tensor 'missing'"):
            reader.read("missing")


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda p: p.write_bytes(b""), "is empty \\(0 bytes\\)"),
        (lambda p: p.write_bytes(b"\x01\x02"), "fewer than the 8-byte header length"),
        (
            lambda p: raw_safetensors(p, {"a": {}}, header_len=10**6),
            "header length \\(1000000 bytes\\) runs past the end",
        ),
        (lambda p: p.write_bytes(struct.pack("<Q", 5) + b"{not}"), "JSON header cannot be parsed"),
        (lambda p: raw_safetensors(p, [1, 2]), "JSON header is not an object"),
        (
            lambda p: raw_safetensors(p, {"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
            "unknown dtype 'F99'",
        ),
        (
            lambda p: raw_safetensors(p, {"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
            "invalid shape",
        ),
        (
            lambda p: raw_safetensors(p, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4),
            "outside the 4 bytes of data",
        ),
        (
            lambda p: raw_safetensors(p, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 8),
            "spans 4 bytes but its shape and dtype need 8",
        ),
        (
            lambda p: raw_safetensors(
                p,
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
                },
                b"\0" * 12,
            ),
            "tensors 'a' and 'b' overlap",
        ),
    ],
    ids=[
        "empty",
        "tiny",
        "header-past-end",
        "garbled-json",
        "json-not-object",
        "bad-dtype",
        "bad-shape",
        "offset-out-of-range",
        "size-mismatch",
        "overlap",
    ],
)
def test_broken_safetensors_are_refused_with_the_fix(tmp_path, make, problem):
    path = tmp_path / "broken.safetensors"
    make(path)
    with pytest.raises(ModelFileError, match=problem) as caught:
        read_header(path)
    message = str(caught.value)
    assert "broken.safetensors" in message
    assert "again" in message  # the fix: download / copy it again


def test_a_file_that_changes_after_its_header_was_read_is_caught(good, tmp_path):
    path, _ = good
    header = read_header(path)
    with open(path, "r+b") as handle:  # the file shrinks after its header was read
        handle.truncate(header.data_start + 2)
    with pytest.raises(ModelFileError, match="changed after its header was read"):
        WeightReader(header).__enter__()


def test_a_file_deleted_after_its_header_was_read_is_named_with_the_fix(good):
    path, _ = good
    header = read_header(path)
    os.remove(path)
    with pytest.raises(ModelFileError, match=r"good.safetensors is gone.*Put it back"):
        WeightReader(header).__enter__()


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ({"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}, "unknown dtype"),
        ({"dtype": "F32", "shape": [0, 2**70], "data_offsets": [0, 0]}, "invalid shape"),
        ({"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]}, "invalid shape"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [False, True]}, "invalid data offsets"),
    ],
    ids=["dtype-not-a-string", "huge-dimension", "too-many-dimensions", "boolean-offsets"],
)
def test_crafted_entries_are_refused_cleanly(tmp_path, entry, problem):
    path = raw_safetensors(tmp_path / "crafted.safetensors", {"a": entry}, b"\0" * 4)
    with pytest.raises(ModelFileError, match=problem):
        read_header(path)


def test_a_deeply_nested_header_is_refused_cleanly(tmp_path):
    path = tmp_path / "deep.safetensors"
    raw = b"[" * 100000 + b"]" * 100000
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(ModelFileError, match="JSON header cannot be parsed"):
        read_header(path)


def test_a_header_length_starting_with_pk_is_still_safetensors(tmp_path):
    tensors = {"w": torch.ones(2)}
    path = tmp_path / "pk.sft"
    save_file(tensors, str(path))
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    padded = json.loads(path.read_bytes()[8 : 8 + header_len])
    raw = json.dumps(padded).encode()
    raw += b" " * (0x4B50 + 65536 * 2 - len(raw))  # a length whose first two bytes are "PK"
    data = path.read_bytes()[8 + header_len :]
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    assert path.read_bytes()[:2] == b"PK"
    header = read_header(path)
    assert header.format == "safetensors" and header.tensors["w"].shape == (2,)


def test_a_directory_a_missing_file_and_gguf_are_named(tmp_path):
    with pytest.raises(ModelFileError, match="is a directory, not a model file"):
        read_header(tmp_path)
    with pytest.raises(ModelFileError, match="does not exist"):
        read_header(tmp_path / "nope.safetensors")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(ModelFileError, match=r"model.gguf is not a valid GGUF file: it is GGUF version 0"):
        read_header(gguf)  # a valid one is refused naming a GGUF loader: tests/core/test_gguf_header.py


def test_a_safe_pickle_is_read_without_its_weights(tmp_path):
    path = tmp_path / "model.ckpt"
    torch.save({"state_dict": {"x.weight": torch.ones(3, 2, dtype=torch.float16)}, "global_step": 10}, path)
    header = read_header(path)
    assert header.format == "pickle"
    assert header.tensors["x.weight"].shape == (3, 2) and header.tensors["x.weight"].dtype == "F16"
    with WeightReader(header) as reader:
        assert torch.equal(reader.read("x.weight"), torch.ones(3, 2, dtype=torch.float16))


class _Payload:
    """A pickle that would create a file when unpickled: the classic attack on .ckpt files."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch's note about the protocol of our evil file
def test_an_unsafe_pickle_is_refused_and_its_code_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.ckpt"
    with open(path, "wb") as handle:
        pickle.dump({"state_dict": {"x": _Payload(str(marker))}}, handle)
    with pytest.raises(UnsafePickleError, match=r"evil.ckpt is an unsafe pickle.*Convert it to .safetensors"):
        read_header(path)
    assert not marker.exists()


def test_a_pickle_without_tensors_is_named(tmp_path):
    path = tmp_path / "notes.pt"
    torch.save({"epoch": 3}, path)
    with pytest.raises(ModelFileError, match="holds no tensors"):
        read_header(path)
