"""The bridge against real ComfyUI objects, in this process: ModelPatcher, load_models_gpu, LoadedModel.

These are ComfyUI's own classes and functions (imported from the provisioned tree, CPU mode); only the
models are small. They cover what a server cannot show on demand: a model freed while the report is being
made, a model whose sizes cannot be read, and ComfyUI changing its list while reports are made.
"""

from __future__ import annotations

import gc
import importlib
import threading

import pytest
import torch


@pytest.fixture(scope="module")
def comfy(comfy_runtime):
    from tools.runtime.inprocess import import_comfy, import_pack

    mm = import_comfy()
    pack = import_pack()
    patcher_module = importlib.import_module("comfy.model_patcher")
    bridge = importlib.import_module(f"{pack.__name__}.nodes.bridge")
    report = importlib.import_module(f"{pack.__name__}.nodes.memory_report")
    state = importlib.import_module(f"{pack.__name__}.nodes.state")
    yield mm, patcher_module.ModelPatcher, bridge, report, state.inventory
    mm.unload_all_models()


def patcher_for(model_patcher_class, size=256):
    cpu = torch.device("cpu")
    return model_patcher_class(torch.nn.Sequential(torch.nn.Linear(size, size), torch.nn.LayerNorm(size)), cpu, cpu)


def test_loaded_model_is_described_from_comfyui_books(comfy):
    mm, model_patcher, bridge, _report, inventory = comfy
    patcher = patcher_for(model_patcher)
    mm.load_models_gpu([patcher])
    models, notes = bridge.loaded_models(inventory.snapshot())
    ours = [m for m in models if m.model_class == "Sequential"]
    assert len(ours) == 1 and notes == []
    expected = (256 * 256 + 256 + 2 * 256) * 4
    assert ours[0].total_bytes == expected == patcher.model_size()
    assert ours[0].resident == (("cpu", expected),)
    assert ours[0].dtype == "float32" and ours[0].component == "other" and not ours[0].partial
    mm.unload_all_models()


def test_model_freed_while_listed_becomes_a_note(comfy):
    mm, model_patcher, bridge, _report, inventory = comfy
    patcher = patcher_for(model_patcher)
    mm.load_models_gpu([patcher])
    module = patcher.model  # the module lives on (as it does when clones share it); the patcher does not
    del patcher
    gc.collect()
    stale = [entry for entry in mm.current_loaded_models if entry.model is None]
    assert stale, "expected ComfyUI to still list the freed model until its next cleanup"
    models, notes = bridge.loaded_models(inventory.snapshot())
    assert any("freed while the report was being made" in note for note in notes)
    assert all(m.model_class != "Sequential" for m in models)
    del module
    gc.collect()
    mm.cleanup_models()


def test_unreadable_model_becomes_a_note_and_the_others_are_listed(comfy):
    mm, model_patcher, _bridge, report_module, _inventory = comfy
    good, broken = patcher_for(model_patcher, 64), patcher_for(model_patcher, 32)
    mm.load_models_gpu([good, broken])
    module = broken.model
    broken.model = None  # a patcher whose model was taken away: reading its sizes raises
    report = report_module.make_report(label="broken")
    assert any("could not read" in note and "NoneType" in note for note in report.notes)
    assert any(m.total_bytes == good.model_size() for m in report.models)
    assert "could not read" in report.to_text()
    broken.model = module  # let ComfyUI unload it cleanly
    mm.unload_all_models()


def test_reports_survive_comfyui_changing_its_list_meanwhile(comfy):
    mm, model_patcher, _bridge, report_module, _inventory = comfy
    keep = [patcher_for(model_patcher, 32) for _ in range(4)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            try:
                mm.load_models_gpu(keep[:2])
                mm.load_models_gpu(keep[2:])
                mm.unload_all_models()
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)
                return

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        counts = set()
        for _ in range(200):
            report = report_module.make_report()
            counts.add(len(report.models))
            assert report.to_text()
    finally:
        stop.set()
        worker.join()
    assert not errors
    assert len(counts) > 1, "the list never changed while reporting; the test did not exercise anything"
    mm.unload_all_models()


def test_passthrough_model_is_described(comfy):
    _mm, model_patcher, _bridge, report_module, _inventory = comfy
    patcher = patcher_for(model_patcher, 16)
    report = report_module.make_report(patcher, "subject")
    assert report.subject is not None and report.subject.total_bytes == patcher.model_size()
    assert "Input at this point:" in report.to_text()


def test_a_dynamic_vram_model_is_taken_over_through_its_classic_clone(comfy):
    """ComfyUI >= 0.16's Dynamic VRAM patcher cannot run here (no NVIDIA GPU, no comfy-aimdo): this checks the
    take-over path against its documented interface (is_dynamic(), clone(disable_dynamic=True))."""
    _mm, model_patcher, bridge, _report, _inventory = comfy
    moves = importlib.import_module(f"{bridge.__name__}.moves")
    patcher_class = importlib.import_module(f"{bridge.__name__}.patcher").DeviceControlPatcher
    errors = importlib.import_module(bridge.__name__.replace("nodes.bridge", "core.errors"))
    asked = []

    class Dynamic(model_patcher):
        def is_dynamic(self):
            return True

        def clone(self, disable_dynamic=False):
            asked.append(disable_dynamic)
            if not disable_dynamic:
                raise AssertionError("a dynamic model must be cloned as a classic one to be placed")
            classic = model_patcher.clone(self)
            classic.__class__ = model_patcher
            return classic

    dynamic = patcher_for(Dynamic)
    moved = moves.clone_subject(moves.require_subject(dynamic))
    assert asked == [True] and isinstance(moved.patcher, patcher_class) and moved.patcher.model is dynamic.model

    class Unbuildable(Dynamic):
        def clone(self, disable_dynamic=False):
            raise RuntimeError("no patcher factory to rebuild this model")

    with pytest.raises(errors.DeviceControlError, match="--disable-dynamic-vram"):
        moves.clone_subject(moves.require_subject(patcher_for(Unbuildable)))
