"""One model shared out over several devices: the allocation grammar as users type it, and which device holds
which whole blocks (a Flux-shaped model of ``core.weights.ops`` layers and a UNet-shaped one)."""

from __future__ import annotations

import itertools

import pytest
import torch

from core.devices.inventory import DeviceSpec
from core.errors import InvalidAllocationError
from core.placement.allocation import AUTO, Entry, parse_allocation
from core.placement.plan import layers_of
from core.placement.split import auto_allocation, blocks_of, split_blocks, spread_split
from core.weights import ops
from tests.core.split_net import FluxShaped

KiB = 1024
GPU0, GPU1, GPU2, CPU = DeviceSpec("gpu", 0), DeviceSpec("gpu", 1), DeviceSpec("gpu", 2), DeviceSpec("cpu")


def _flux_blocks(**kwargs):
    model = FluxShaped(**kwargs)
    return model, blocks_of(model, layers_of(model))


# --- the grammar -----------------------------------------------------------------------------------------------


def test_the_three_forms_of_the_issue_parse():
    sizes = parse_allocation("gpu:0=10GB, gpu:1=12GB, cpu=*")
    assert sizes.entries == (Entry(GPU0, size=10 * 1024**3), Entry(GPU1, size=12 * 1024**3), Entry(CPU))
    shares = parse_allocation(" GPU:0 = 40% ,gpu:1=60%")
    assert shares.entries == (Entry(GPU0, share=0.4), Entry(GPU1, share=0.6))
    assert parse_allocation("Auto") is AUTO and AUTO.is_auto
    assert str(sizes) == "gpu:0=10.00 GiB, gpu:1=12.00 GiB, cpu=*" and str(shares) == "gpu:0=40%, gpu:1=60%"


def test_capacities_are_sizes_shares_of_the_model_and_the_rest():
    mixed = parse_allocation("gpu:0=1GB, gpu:1=25%, cpu=*")
    assert mixed.capacities(8 * 1024**3) == [(GPU0, 1024**3), (GPU1, 2 * 1024**3), (CPU, 5 * 1024**3)]
    assert parse_allocation("gpu:0=10GB, cpu=*").capacities(4 * 1024**3)[1] == (CPU, 0)  # never below 0
    with pytest.raises(InvalidAllocationError, match="free memory"):
        AUTO.capacities(100)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "empty; write it as 'gpu:0=10GB, gpu:1=12GB, cpu=\\*'"),
        ("gpu:0 10GB", "not 'device=amount'; write it as"),
        ("gpu:0=", "not 'device=amount'"),
        ("gpu:0=10GB,", "not 'device=amount'"),
        ("tpu:0=10GB", "'tpu:0' is not a device; use one of"),
        ("auto=50%, cpu=*", "names the device 'auto'"),
        ("gpu:0=10GB, gpu:0=2GB", "names gpu:0 twice; give each device once"),
        ("gpu:0=*, cpu=*", "more than one '\\*'"),
        ("gpu:0=140%", "a share is of the model, at most 100%"),
        ("gpu:0=60%, gpu:1=50%", "add up to 110%; they may add up to 100% at most"),
        ("gpu:0=ten", "gpu:0: 'ten' is not a memory size"),
        ("gpu:0=-2GB", "negative"),
    ],
)
def test_a_bad_allocation_is_refused_with_what_is_wrong_and_the_grammar(text, problem):
    with pytest.raises(InvalidAllocationError, match=problem):
        parse_allocation(text)


# --- blocks ----------------------------------------------------------------------------------------------------


def test_blocks_are_the_outermost_list_items_with_the_small_layers_around_them():
    model, blocks = _flux_blocks()
    names = [block.name for block in blocks]
    assert names == [*(f"double_blocks.{i}" for i in range(4)), *(f"single_blocks.{i}" for i in range(4))]
    first = [layer.name for layer in blocks[0].layers]
    assert first[:2] == ["img_in", "time_in"] and "double_blocks.0.mlp.0" in first  # before it
    assert blocks[-1].layers[-1].name == "final_layer.linear"  # after the last block: with it
    assert sum(block.nbytes for block in blocks) == sum(layer.nbytes for layer in layers_of(model))


def test_a_unet_s_composite_sequence_items_are_blocks_and_the_lists_inside_a_block_stay_in_it():
    class Inner(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer_blocks = torch.nn.ModuleList(ops.Linear(8, 8) for _ in range(3))

    class UNetShaped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.time_embed = torch.nn.Sequential(ops.Linear(4, 8), torch.nn.SiLU(), ops.Linear(8, 8))
            self.label_emb = torch.nn.Sequential(torch.nn.Sequential(ops.Linear(4, 8), ops.Linear(8, 8)))
            self.input_blocks = torch.nn.ModuleList([torch.nn.Sequential(ops.Linear(8, 8), Inner())] * 1)
            self.middle_block = torch.nn.Sequential(ops.Linear(8, 8), Inner())
            self.output_blocks = torch.nn.ModuleList(torch.nn.Sequential(ops.Linear(8, 8)) for _ in range(2))
            self.out = torch.nn.Sequential(ops.GroupNorm(2, 8), ops.Linear(8, 4))

    model = UNetShaped()
    blocks = blocks_of(model, layers_of(model))
    names = [block.name for block in blocks]
    assert names == ["input_blocks.0", "middle_block.1", "output_blocks.0", "output_blocks.1"]
    first = [layer.name for layer in blocks[0].layers]
    assert first[:4] == ["time_embed.0", "time_embed.2", "label_emb.0.0", "label_emb.0.1"]  # single layers
    assert [layer.name for layer in blocks[1].layers] == [  # a layer of the sequence goes with the next item
        "middle_block.0",
        *(f"middle_block.1.transformer_blocks.{i}" for i in range(3)),  # one block, not three
    ]
    assert [layer.name for layer in blocks[-1].layers][-2:] == ["out.0", "out.1"]


def test_a_model_without_lists_or_sequences_is_split_between_its_top_modules():
    class Plain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = ops.Linear(4, 4), ops.Linear(4, 4)

    model = Plain()
    assert [block.name for block in blocks_of(model, layers_of(model))] == ["a", "b"]


# --- runs ------------------------------------------------------------------------------------------------------


def test_sizes_are_limits_and_each_device_holds_one_contiguous_run_in_model_order():
    _model, blocks = _flux_blocks()
    size = blocks[1].nbytes  # the blocks after the first are the same size
    allocation = parse_allocation(f"gpu:0={blocks[0].nbytes + size + size // 2}B, gpu:1={3 * size}B, cpu=*")
    split = split_blocks(blocks, allocation)
    assert [[block.name for block in part.blocks] for part in split.parts] == [
        ["double_blocks.0", "double_blocks.1"],
        ["double_blocks.2", "double_blocks.3", "single_blocks.0"],
        ["single_blocks.1", "single_blocks.2", "single_blocks.3"],
    ]
    assert all(part.nbytes <= part.allowed for part in split.parts[:2])  # within every size
    device_of = split.device_of()
    assert device_of["img_in"] == GPU0 and device_of["final_layer.linear"] == CPU
    assert split.total_bytes == sum(block.nbytes for block in blocks)
    assert split.summary().splitlines()[1].startswith("gpu:1: ") and "double_blocks.2 to single_blocks.0" in (
        split.summary()
    )


def test_shares_end_each_run_at_the_nearest_block_boundary_and_the_last_device_takes_the_rest():
    _model, blocks = _flux_blocks(double=5, single=5)
    total = sum(block.nbytes for block in blocks)
    split = split_blocks(blocks, parse_allocation("gpu:0=40%, gpu:1=60%"))
    first, second = split.parts
    assert abs(first.nbytes - 0.4 * total) <= max(block.nbytes for block in blocks) / 2
    assert first.nbytes + second.nbytes == total and second.blocks[-1] is blocks[-1]


def test_a_rest_that_is_not_last_leaves_the_devices_after_it_what_they_may_hold():
    _model, blocks = _flux_blocks()
    last_two = blocks[-1].nbytes + blocks[-2].nbytes
    split = split_blocks(blocks, parse_allocation(f"gpu:0=*, gpu:1={last_two}B"))
    assert split.parts[1].blocks == tuple(blocks[-2:]) and split.parts[0].blocks == tuple(blocks[:-2])


def test_the_whole_model_on_the_first_device_leaves_the_others_empty():
    _model, blocks = _flux_blocks()
    split = split_blocks(blocks, parse_allocation("gpu:0=100GB, gpu:1=100GB, cpu=*"))
    assert [len(part.blocks) for part in split.parts] == [len(blocks), 0, 0]
    assert split.parts[1].describe(split.total_bytes) == "gpu:1: nothing"


# --- spread (stream mode) ----------------------------------------------------------------------------------------


def test_a_spread_deals_each_devices_blocks_over_the_whole_model_keeping_its_bytes():
    _model, blocks = _flux_blocks(double=6, single=6)
    runs = split_blocks(blocks, parse_allocation("gpu:0=50%, gpu:1=*"))
    spread = spread_split(runs)
    devices = {name: str(device) for name, device in spread.device_of().items()}
    order = [devices[block.layers[0].name] for block in blocks]
    assert order[0] == "gpu:0"  # the pass starts on the computing device: its first copy has nothing before it
    assert max(len(list(run)) for _device, run in itertools.groupby(order)) <= 2, order  # alternating, about
    assert order[1:3].count("gpu:1") and order[-3:].count("gpu:0"), order  # from start to end
    assert sorted(block.name for part in spread.parts for block in part.blocks) == sorted(b.name for b in blocks)
    largest = max(block.nbytes for block in blocks)
    for dealt, run in zip(spread.parts, runs.parts, strict=True):
        assert abs(dealt.nbytes - run.nbytes) <= largest and dealt.spread
    assert spread.parts[1].describe(spread.total_bytes).startswith("gpu:1: ")
    assert "blocks spread from double_blocks." in spread.summary()


def test_a_spread_keeps_every_size_limit_and_leaves_a_split_it_cannot_deal_as_it_was():
    _model, blocks = _flux_blocks(double=5, single=5)
    size = blocks[1].nbytes
    runs = split_blocks(blocks, parse_allocation(f"gpu:0={blocks[0].nbytes + 3 * size}B, gpu:1={2 * size}B, cpu=*"))
    spread = spread_split(runs)
    assert [part.nbytes for part in spread.parts] == [part.nbytes for part in runs.parts]  # same-sized blocks
    assert all(part.nbytes <= part.allowed for part in spread.parts[:2])
    assert len({str(part.device) for part in spread.parts if part.blocks}) == 3
    whole = split_blocks(blocks, parse_allocation("gpu:0=100GB, cpu=*"))
    assert spread_split(whole) is whole  # one device holds everything: nothing to deal
    tight = split_blocks(blocks, parse_allocation(f"gpu:0={runs.parts[0].nbytes}B, gpu:1=*"))
    tight_last = split_blocks(blocks, parse_allocation(f"gpu:0=*, gpu:1={blocks[-1].nbytes + size // 2}B"))
    for split in (tight, tight_last):
        dealt = spread_split(split)
        assert all(
            part.nbytes <= max(part.allowed, run.nbytes) for part, run in zip(dealt.parts, split.parts, strict=True)
        )


def test_an_allocation_smaller_than_the_model_is_refused_with_the_shortfall_and_a_fix():
    _model, blocks = _flux_blocks()
    total = sum(block.nbytes for block in blocks)
    with pytest.raises(InvalidAllocationError, match=r"short\. Give a device more, add 'cpu=\*'") as refused:
        split_blocks(blocks, parse_allocation(f"gpu:0={total // 4}B, gpu:1={total // 4}B"))
    assert "holds" in str(refused.value)
    with pytest.raises(InvalidAllocationError, match="short"):
        split_blocks(blocks, parse_allocation("gpu:0=30%, gpu:1=30%"))


def test_sizes_that_add_up_but_cannot_hold_the_blocks_whole_are_refused_naming_the_device_and_the_size_needed():
    _model, blocks = _flux_blocks()
    total = sum(block.nbytes for block in blocks)
    half = blocks[0].nbytes + blocks[1].nbytes + blocks[2].nbytes // 2  # ends inside a block
    with pytest.raises(InvalidAllocationError, match=r"placed in whole blocks.*Give gpu:1 at least"):
        split_blocks(blocks, parse_allocation(f"gpu:0={half}B, gpu:1={total - half}B"))


def test_auto_fills_the_accelerators_with_the_most_free_memory_first_keeping_room_then_the_cpu():
    allocation = auto_allocation({GPU0: 4 * 1024**3, GPU1: 8 * 1024**3, GPU2: 100, CPU: 64 * 1024**3}, 1024**3)
    assert allocation.entries == (
        Entry(GPU1, size=7 * 1024**3),
        Entry(GPU0, size=3 * 1024**3),
        Entry(GPU2, size=0),
        Entry(CPU),
    )
