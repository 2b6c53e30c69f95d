"""Plans: which layers stay resident under a budget, with each policy, and the room kept to stream the rest."""

from __future__ import annotations

import pytest
import torch

from core.placement.plan import STREAM_COPIES, Policy, layers_of, plan_layers
from core.weights import ops
from tests.core.small_net import sizes

MiB = 1024**2


def test_layers_and_sizes_follow_the_module_tree(net):
    layers = layers_of(net)
    assert [la.name for la in layers][:6] == ["first", "norm", "middle", "fixed", "back", "tail.0"]
    assert sizes(net)["middle"] == (64 * 512 + 512) * 4
    assert sizes(net)["fixed"] == 3 * 512 * 4  # buffers count, saved or not: they take device memory
    assert [la.streamable for la in layers][:5] == [True, True, True, False, True]


def test_tied_weights_count_once():
    net = torch.nn.Sequential(ops.Embedding(10, 8), ops.Linear(8, 10, bias=False))
    net[1].weight = net[0].weight
    assert sum(la.nbytes for la in layers_of(net)) == 10 * 8 * 4


def test_everything_resident_when_it_fits(net):
    layers = layers_of(net)
    plan = plan_layers(layers, 10 * MiB)
    assert plan.resident == {la.name for la in layers} and plan.streamed_bytes == 0 and plan.reserve_bytes == 0


def shelf(*dims: int) -> torch.nn.ModuleList:
    """Independent square layers of these widths, in this order."""
    return torch.nn.ModuleList([ops.Linear(d, d) for d in dims])


@pytest.mark.parametrize("policy", list(Policy))
def test_plans_stay_within_the_budget_with_room_to_stream(policy):
    layers = layers_of(shelf(32, 48, 128, 32, 64, 32))
    total = sum(la.nbytes for la in layers)
    for budget in range(0, total + 1, total // 50):
        plan = plan_layers(layers, budget, policy)
        streamed = [la.nbytes for la in layers if la.name not in plan.resident]
        assert plan.reserve_bytes == STREAM_COPIES * max(streamed, default=0)
        assert plan.resident_bytes + plan.reserve_bytes <= budget or not plan.resident


def test_execution_order_keeps_a_run_from_the_start():
    layers = layers_of(shelf(32, 32, 32, 32, 32, 32))
    small = layers[0].nbytes
    plan = plan_layers(layers, 2 * small + STREAM_COPIES * small, Policy.EXECUTION_ORDER)
    assert plan.resident == {"0", "1"} and plan.streamed_layers == 4


def test_largest_first_keeps_the_big_layer_that_execution_order_must_stream():
    layers = layers_of(shelf(32, 32, 128, 32, 32, 32))
    small, big = layers[0].nbytes, layers[2].nbytes
    budget = big + STREAM_COPIES * small + small // 2
    assert plan_layers(layers, budget, Policy.LARGEST_FIRST).resident == {"2"}
    assert plan_layers(layers, budget, Policy.EXECUTION_ORDER).resident == frozenset()


def test_an_unload_plan_only_keeps_layers_that_were_resident():
    layers = layers_of(shelf(32, 32, 32, 32))
    plan = plan_layers(layers, 10 * MiB, allowed=["0", "1"])
    assert plan.resident == {"0", "1"}


def test_a_budget_below_the_fixed_layers_keeps_them_and_says_so(net):
    plan = plan_layers(layers_of(net), 0)
    assert plan.resident == {"fixed"} and plan.over_budget
