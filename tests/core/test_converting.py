"""Conversions through float32 in steps give exactly what torch's direct conversion gives, for every value."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from core.detection.headers import read_header
from core.files import converting
from core.files.converting import VIA_FLOAT32, Float32Steps
from core.files.reader import WeightReader

REDUCED = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def every_value(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of a 16- or 8-bit dtype (NaNs, infinities, subnormals and both zeros included)."""
    if dtype.itemsize == 2:
        return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return torch.arange(-(2**7), 2**7, dtype=torch.int32).to(torch.int8).view(dtype)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int8)


@pytest.fixture(params=[True, False], ids=["per-thread-counts", "process-count"])
def counts(request, monkeypatch):
    """Both ways of stepping: large steps on threads that run torch alone, small ones below torch's grain."""
    monkeypatch.setattr(converting, "thread_counts_are_per_thread", lambda: request.param)
    return request.param


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(("stored", "target"), [(s, t) for s in REDUCED for t in (*REDUCED, torch.float32) if s != t])
def test_every_value_converts_bit_for_bit_as_torch_converts_it(monkeypatch, counts, stored, target, threads):
    monkeypatch.setattr(converting, "STEP", 1000)  # many steps, and a last one that is shorter
    monkeypatch.setattr(converting, "LARGE_STEP", 1000)
    monkeypatch.setattr(converting, "SPLIT_FROM", 20)  # 16-bit values: three parts, one per thread
    source = every_value(stored)
    got = torch.empty(source.shape, dtype=target)
    steps = Float32Steps(threads)
    steps.copy(got, source)
    steps.release()
    expected = source.to(target)
    assert torch.equal(bits(got) if target.itemsize < 4 else got.view(torch.int32), bits(expected)
                       if target.itemsize < 4 else expected.view(torch.int32))  # fmt: skip


def test_the_pairs_through_float32_are_the_slow_reduced_ones():
    assert all(stored in REDUCED and target in REDUCED for stored, target in VIA_FLOAT32)
    assert (torch.float16, torch.float8_e4m3fn) in VIA_FLOAT32  # an fp16 file loaded as fp8
    assert (torch.bfloat16, torch.float8_e4m3fn) not in VIA_FLOAT32  # as fast directly


def test_a_reader_converts_a_file_through_float32_in_any_shape(tmp_path, monkeypatch, counts):
    monkeypatch.setattr(converting, "STEP", 777)
    monkeypatch.setattr(converting, "LARGE_STEP", 777)
    weights = {"a": torch.randn(96, 40).half(), "b": torch.randn(3, 5, 7).half()}
    save_file(weights, tmp_path / "w.safetensors")
    with WeightReader(read_header(tmp_path / "w.safetensors")) as reader:
        for name, tensor in weights.items():
            for target in (torch.float8_e4m3fn, torch.bfloat16):
                got = torch.empty(tensor.shape, dtype=target)
                reader.read_into(name, got)
                assert torch.equal(bits(got), bits(tensor.to(target))), (name, target)


def test_tensors_made_in_inference_mode_are_converted_by_every_thread(monkeypatch, counts):
    """ComfyUI runs nodes in inference mode; a tensor made there can only be written there, on any thread."""
    monkeypatch.setattr(converting, "SPLIT_FROM", 1000)
    steps = Float32Steps(2)
    with torch.inference_mode():
        source = torch.randn(10_000).half()
        got = torch.empty(10_000, dtype=torch.float8_e4m3fn)
        steps.copy(got, source)
        empty = torch.empty(0, dtype=torch.float8_e4m3fn)
        steps.copy(empty, source[:0])
    steps.release()
    assert torch.equal(bits(got), bits(source.to(torch.float8_e4m3fn)))


@pytest.mark.skipif(not converting.thread_counts_are_per_thread(), reason="torch keeps one thread count per process")
def test_converting_threads_run_torch_alone_and_leave_the_callers_count(monkeypatch):
    """Large steps run on threads set to one torch thread; the calling thread (ComfyUI's) keeps its count."""
    monkeypatch.setattr(converting, "SPLIT_FROM", 1000)
    before = torch.get_num_threads()
    steps = Float32Steps(2)
    source = torch.randn(3 * converting.LARGE_STEP + 5).half()
    got = torch.empty(source.shape, dtype=torch.float8_e4m3fn)
    steps.copy(got, source)
    counts = [steps._pool.submit(torch.get_num_threads).result() for _ in range(4)]
    steps.release()
    assert torch.get_num_threads() == before
    assert counts == [1, 1, 1, 1]
    assert torch.equal(bits(got), bits(source.to(torch.float8_e4m3fn)))
