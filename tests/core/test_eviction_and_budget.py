"""Making room on a device by evicting other models, and budgets as users write them."""

from __future__ import annotations

import pytest
import torch

from core.devices.sim.device import SimulatedDevice
from core.placement.budget import Budget
from core.placement.engine import partial_model_of
from core.placement.eviction import make_room
from core.placement.plan import layers_of
from tests.core.small_net import Net

MiB = 1024**2


class Loaded:
    """A model loaded on a device, offered to ``make_room`` the way the host's list offers its entries."""

    def __init__(self, name: str, root: torch.nn.Module, keep_resident: bool = False) -> None:
        self.name, self.engine, self.keep_resident = name, partial_model_of(root), keep_resident
        self.device = "gpu:0"

    def resident_on(self, target):
        return self.engine.resident_bytes(target) if self.engine.target is target else 0

    def give_back(self, target, nbytes):
        return self.engine.unload_all() if nbytes is None else self.engine.unload(nbytes)


def test_make_room_evicts_least_recently_used_first_partially_and_spares_kept_models():
    nets = [Net() for _ in range(3)]
    total = sum(la.nbytes for la in layers_of(nets[0]))
    device = SimulatedDevice(2 * total + total // 2)
    kept, older, newest = Loaded("kept", nets[0], True), Loaded("older", nets[1]), Loaded("newest", nets[2])
    for model in (kept, older):
        model.engine.load(device, total)
    eviction = make_room([older, kept], device, total)  # most recently used first, as ComfyUI lists them
    assert [given.name for given in eviction.evicted] == ["older"] and eviction.short == 0
    assert 0 < older.resident_on(device) < total  # it gave back only what was missing, streaming the rest
    newest.engine.load(device, total)
    assert kept.resident_on(device) == total == newest.resident_on(device)
    assert device.allocated() == sum(m.resident_on(device) for m in (kept, older, newest))


def test_make_room_gives_kept_models_only_when_asked():
    nets = [Net(), Net()]
    total = sum(la.nbytes for la in layers_of(nets[0]))
    device = SimulatedDevice(2 * total)
    models = [Loaded("b", nets[1], True), Loaded("a", nets[0], True)]
    for model in models:
        model.engine.load(device, total)
    assert make_room(models, device, total).short == total
    eviction = make_room(models, device, total, include_kept=True)
    assert eviction.short == 0 and [given.name for given in eviction.evicted] == ["a"]  # least recently used


@pytest.mark.parametrize(
    ("text", "capacity", "expected"),
    [("all", 8 * MiB, 8 * MiB), ("", 8, 8), ("2MiB", 8 * MiB, 2 * MiB), ("50%", 8 * MiB, 4 * MiB), ("0", 8, 0)],
)
def test_budgets_resolve_against_the_device(text, capacity, expected):
    assert Budget.parse(text).resolve(capacity) == expected


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("-1GB", "negative"),
        ("nan", "not a finite"),
        ("nan%", "between 0% and 100%"),
        ("150%", "between 0% and 100%"),
        ("lots", "Accepted forms"),
    ],
)
def test_bad_budgets_are_refused_with_the_accepted_forms(text, problem):
    with pytest.raises(ValueError, match=problem):
        Budget.parse(text)


def test_a_budget_larger_than_the_device_names_the_largest_one():
    with pytest.raises(ValueError, match=r"larger than gpu:0, which holds 8.00 MiB; use at most that"):
        Budget.parse("1GB").resolve(8 * MiB, device="gpu:0")
