"""Building modules without weight memory, tracing where each weight comes from, and filling them once."""

from __future__ import annotations

import threading
from functools import partial

import pytest
import torch
from safetensors.torch import save_file

from core.detection.headers import read_header
from core.devices.backends import backend_of
from core.devices.sim.device import SimulatedDevice
from core.errors import ModelFileError
from core.files import lineage
from core.files.lineage import Tracer, capture_state_dict_loads, source_of, source_tensors
from core.files.reader import WeightReader
from core.files.skeleton import materialize, weights_on_meta


class Layer(torch.nn.Module):
    """Allocates like ComfyUI's layers: an uninitialised weight, and a scale of 1 on the weight's device."""

    def __init__(self, device="cpu"):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(64, 32, device=device))
        self.scale = torch.nn.Parameter(torch.ones((), device=self.weight.device))
        self.register_buffer("table", torch.empty(128, 8, device=device))
        self.register_buffer("steps", torch.arange(10, device=device))


def test_large_empty_tensors_go_to_meta_and_values_stay_real():
    with weights_on_meta():
        layer = Layer()
    assert layer.weight.device.type == "meta" and layer.table.device.type == "meta"
    assert layer.scale.device.type == "cpu" and layer.scale.item() == 1.0  # made on the weight's (meta) device
    assert torch.equal(layer.steps, torch.arange(10))
    assert Layer().weight.device.type == "cpu"  # outside the context, nothing changes


def test_the_mode_only_affects_its_own_thread():
    seen = {}
    entered, done = threading.Event(), threading.Event()

    def other():
        entered.wait()
        seen["other"] = Layer().weight.device.type
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with weights_on_meta():
        entered.set()
        done.wait()
    thread.join()
    assert seen["other"] == "cpu"


@pytest.fixture
def weight_file(tmp_path):
    torch.manual_seed(0)
    tensors = {"w": torch.randn(64, 32).half(), "t": torch.randn(128, 8), "qkv": torch.randn(96, 32)}
    path = tmp_path / "weights.safetensors"
    save_file(tensors, str(path))
    return read_header(path), tensors


def test_materialize_fills_from_the_file_in_the_constructed_dtype(weight_file):
    header, tensors = weight_file
    with weights_on_meta():
        layer = Layer()
    with WeightReader(header) as reader:
        result = materialize(layer, {"weight": "w", "table": "t"}, reader)
    assert layer.weight.dtype == torch.float32 and torch.equal(layer.weight, tensors["w"].float())
    assert isinstance(layer.weight, torch.nn.Parameter) and torch.equal(layer.table, tensors["t"])
    assert layer.scale.item() == 1.0 and result.missing == []


def test_materialize_writes_straight_onto_a_device_through_its_backend(weight_file):
    header, tensors = weight_file
    device = SimulatedDevice(1024**2)
    with weights_on_meta():
        layer = Layer()
    with WeightReader(header) as reader:
        materialize(layer, {"weight": "w", "table": "t"}, reader, partial(backend_of(device).empty, device))
    kept = (layer.weight, layer.table, layer.scale, layer.steps)
    assert all(t.placement_target is device for t in kept)  # the values the constructor made too
    assert isinstance(layer.weight, torch.nn.Parameter) and torch.equal(layer.weight.cpu(), tensors["w"].float())
    assert device.allocated() == sum(t.numel() * t.element_size() for t in kept)


def test_a_fill_that_runs_out_of_device_memory_keeps_no_memory_once_dropped(weight_file):
    header, _ = weight_file
    device = SimulatedDevice(1024**2)
    device.fail_allocation(1)
    with weights_on_meta():
        layer = Layer()
    with WeightReader(header) as reader, pytest.raises(torch.OutOfMemoryError):
        materialize(layer, {"weight": "w", "table": "t"}, reader, partial(backend_of(device).empty, device))
    assert device.allocated() > 0  # the first tensor is filled and held by the module
    del layer
    assert device.allocated() == 0


def test_a_missing_weight_is_zero_and_reported_and_a_missing_buffer_is_an_error(weight_file):
    header, _ = weight_file
    with weights_on_meta():
        layer = Layer()
    with WeightReader(header) as reader, pytest.raises(ModelFileError, match="buffer 'table' is not in the file"):
        materialize(layer, {"weight": "w"}, reader)
    with weights_on_meta():
        layer = Layer()
    with WeightReader(header) as reader:
        result = materialize(layer, {"table": "t"}, reader)
    assert result.missing == ["weight"] and not layer.weight.any()


def test_tied_weights_stay_tied_and_take_the_last_source(weight_file):
    header, tensors = weight_file

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(32, 64, bias=False)
            self.head = torch.nn.Linear(32, 64, bias=False)
            self.head.weight = self.embed.weight

    with weights_on_meta():
        tied = Tied()
    with WeightReader(header) as reader:
        materialize(tied, {"head.weight": "w"}, reader)  # only the second name is in the file
    assert tied.head.weight is tied.embed.weight
    assert torch.equal(tied.embed.weight, tensors["w"].float())


def test_tracing_records_renames_and_transforms_and_replays_them(weight_file):
    header, tensors = weight_file
    stand_ins = source_tensors(header.tensors)
    assert all(t.device.type == "meta" for t in stand_ins.values())
    module = torch.nn.Linear(32, 32, bias=False)
    with capture_state_dict_loads() as captured, Tracer():
        renamed = {"weight": stand_ins["qkv"][32:64]}  # a split, like ComfyUI's in_proj conversion
        module.load_state_dict(renamed)
    ((loaded_module, state),) = captured
    assert loaded_module is module and not torch.equal(module.weight, torch.zeros(32, 32))  # nothing was copied
    with WeightReader(header) as reader:
        source = source_of(state["weight"], reader.read)
        assert torch.equal(source(), tensors["qkv"][32:64])
        assert source_of(stand_ins["w"], reader.read) == "w"


def test_load_state_dict_is_torch_s_own_again_after_a_capture():
    original = torch.nn.Module.load_state_dict
    module = torch.nn.Linear(2, 2, bias=False)
    with capture_state_dict_loads(), capture_state_dict_loads():  # nested: put back when the last one closes
        assert torch.nn.Module.load_state_dict is not original
    assert torch.nn.Module.load_state_dict is original  # no process-wide change is left behind
    module.load_state_dict({"weight": torch.ones(2, 2)})
    assert torch.equal(module.weight, torch.ones(2, 2))


def test_captures_in_two_threads_and_a_plain_load_in_a_third_do_not_mix():
    original = torch.nn.Module.load_state_dict
    both_open, done = threading.Barrier(3), threading.Event()
    captured: dict[str, list] = {}
    plain = torch.nn.Linear(2, 2, bias=False)

    def capture(name: str) -> None:
        module = torch.nn.Linear(2, 2, bias=False)
        with capture_state_dict_loads() as loads:
            both_open.wait()
            module.load_state_dict({"weight": torch.full((2, 2), 3.0)})
            done.wait()
        captured[name] = loads

    threads = [threading.Thread(target=capture, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    both_open.wait()
    plain.load_state_dict({"weight": torch.full((2, 2), 5.0)})  # another thread, while both capture: a real load
    done.set()
    for thread in threads:
        thread.join()
    assert torch.equal(plain.weight, torch.full((2, 2), 5.0))
    assert [len(captured[name]) for name in ("a", "b")] == [1, 1]  # each thread saw only its own load
    assert torch.nn.Module.load_state_dict is original


def test_a_wrapper_another_library_installs_during_a_capture_stays_and_works(monkeypatch):
    original = torch.nn.Module.load_state_dict
    # What the simulated library changes is undone after the test: torch's method, and our note that ours sits
    # beneath a wrapper.
    monkeypatch.setattr(torch.nn.Module, "load_state_dict", original)
    monkeypatch.setattr(lineage, "_beneath", False)
    calls = []
    with capture_state_dict_loads():
        inner = torch.nn.Module.load_state_dict

        def wrapper(module, state_dict, strict=True, assign=False):
            calls.append(module)
            return inner(module, state_dict, strict=strict, assign=assign)

        torch.nn.Module.load_state_dict = wrapper
    assert torch.nn.Module.load_state_dict is wrapper  # not removed: that would undo the other library
    module = torch.nn.Linear(2, 2, bias=False)
    module.load_state_dict({"weight": torch.ones(2, 2)})
    assert calls == [module] and torch.equal(module.weight, torch.ones(2, 2))
    other = torch.nn.Linear(2, 2, bias=False)
    with capture_state_dict_loads() as loads:  # capturing still works beneath the wrapper
        module.load_state_dict({"weight": torch.zeros(2, 2)})
        elsewhere = threading.Thread(target=other.load_state_dict, args=({"weight": torch.ones(2, 2)},))
        elsewhere.start()  # meanwhile another thread loads for real, through the wrapper and ours
        elsewhere.join()
    assert len(loads) == 1 and torch.equal(module.weight, torch.ones(2, 2))
    assert torch.equal(other.weight, torch.ones(2, 2)) and torch.nn.Module.load_state_dict is wrapper
