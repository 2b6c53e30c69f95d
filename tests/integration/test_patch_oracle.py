"""Patch math against ComfyUI's own: for every patch type, our result equals ``comfy.lora.calculate_weight``'s.

ComfyUI's adapter classes hold the patch tensors (our code reads them the way ComfyUI's patcher hands them
over); both sides get identical copies of the same weight. fp32, fp16 and bf16 weights are all compared bit
for bit: the same operations run in the same order and dtypes, so nothing is left to chance.
"""

from __future__ import annotations

import importlib
import logging
import math

import pytest
import torch

from core.devices.slices import row_slices
from core.weights.patch_math import calculate_weight
from core.weights.patching import OnTheFlyPatch, key_seed, round_to


@pytest.fixture(scope="module")
def comfy(comfy_runtime):
    from tools.runtime.inprocess import import_comfy

    import_comfy()
    return (
        importlib.import_module("comfy.lora"),
        importlib.import_module("comfy.weight_adapter"),
        importlib.import_module("comfy.model_patcher"),
        importlib.import_module("comfy.float"),
    )


def randn(*shape: int, scale: float = 0.1) -> torch.Tensor:
    return torch.randn(*shape) * scale


def cases(adapters) -> dict[str, tuple[torch.Tensor, list]]:
    """name -> (weight, patches), built with ComfyUI's own adapter classes."""
    torch.manual_seed(1234)
    out, inp, rank = 24, 16, 4
    linear, conv = randn(out, inp, scale=1.0), randn(out, inp, 3, 3, scale=1.0)
    a = adapters

    def p(value, strength=1.0, strength_model=1.0, offset=None, function=None):
        return [(strength, value, strength_model, offset, function)]

    return {
        "lora": (linear, p(a.LoRAAdapter(set(), (randn(out, rank), randn(rank, inp), 8.0, None, None, None)), 0.7)),
        "lora-no-alpha": (
            linear,
            p(a.LoRAAdapter(set(), (randn(out, rank), randn(rank, inp), None, None, None, None))),
        ),
        "lora-conv-mid": (
            conv,
            p(
                a.LoRAAdapter(
                    set(), (randn(out, rank, 1, 1), randn(rank, inp, 1, 1), 2.0, randn(rank, rank, 3, 3), None, None)
                )
            ),
        ),
        "lora-dora": (
            linear,
            p(
                a.LoRAAdapter(
                    set(), (randn(out, rank), randn(rank, inp), 4.0, None, randn(out, 1, scale=1.0).abs() + 1, None)
                ),
                0.6,
            ),
        ),
        "lora-dora-full": (
            linear,
            p(
                a.LoRAAdapter(
                    set(), (randn(out, rank), randn(rank, inp), 4.0, None, randn(1, inp, scale=1.0).abs() + 1, None)
                )
            ),
        ),
        "loha": (
            linear,
            p(
                a.LoHaAdapter(
                    set(),
                    (randn(out, rank), randn(rank, inp), 4.0, randn(out, rank), randn(rank, inp), None, None, None),
                )
            ),
        ),
        "loha-cp": (
            conv,
            p(
                a.LoHaAdapter(
                    set(),
                    (
                        randn(rank, out),
                        randn(rank, inp),
                        4.0,
                        randn(rank, out),
                        randn(rank, inp),
                        randn(rank, rank, 3, 3),
                        randn(rank, rank, 3, 3),
                        None,
                    ),
                )
            ),
        ),
        "lokr-full": (
            linear,
            p(a.LoKrAdapter(set(), (randn(4, 2), randn(6, 8), None, None, None, None, None, None, None))),
        ),
        "lokr-factored": (
            linear,
            p(a.LoKrAdapter(set(), (randn(4, 2), None, 2.0, None, None, randn(6, 2), randn(2, 8), None, None))),
        ),
        "lokr-tucker": (
            conv,
            p(
                a.LoKrAdapter(
                    set(), (randn(4, 2), None, 2.0, None, None, randn(2, 6), randn(2, 8), randn(2, 2, 3, 3), None)
                )
            ),
        ),
        "glora": (
            linear,
            p(
                a.GLoRAAdapter(
                    set(), (randn(inp, rank), randn(rank, inp), randn(out, rank), randn(rank, inp), 4.0, None)
                )
            ),
        ),
        "glora-old": (
            torch.randn(inp, inp),
            p(
                a.GLoRAAdapter(
                    set(), (randn(rank, inp), randn(inp, rank), randn(rank, inp), randn(inp, rank), 4.0, None)
                )
            ),
        ),
        "oft": (linear, p(a.OFTAdapter(set(), (randn(4, 6, 6), None, 0.5, None)), 0.8)),
        "boft": (torch.randn(16, 8), p(a.BOFTAdapter(set(), (randn(2, 2, 8, 8), None, 1.0, None)))),
        "diff": (linear, p((randn(out, inp),), 0.5)),
        "set": (linear, p(("set", (randn(out, inp),)))),
        "strength-model-offset-function": (linear, p((randn(8, inp),), 0.5, 0.9, (0, 4, 8), lambda t: t * 3)),
        "shape-mismatch": (linear, p((randn(3, 3),))),
        "chain": (
            linear,
            p((randn(out, inp),))
            + p(a.LoRAAdapter(set(), (randn(out, rank), randn(rank, inp), 4.0, None, None, None)), 0.3),
        ),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_patch_type_equals_comfyui(comfy, dtype, caplog):
    lora, adapters, _patcher, _float = comfy
    for name, (weight, patches) in cases(adapters).items():
        theirs = lora.calculate_weight(patches, weight.to(dtype).clone(), name, intermediate_dtype=dtype)
        with caplog.at_level(logging.WARNING):
            ours = calculate_weight(patches, weight.to(dtype).clone(), name, intermediate_dtype=dtype)
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), name
        # Equal because both did the work, not because both skipped it. Some are skipped by both (a warning
        # names the key): a diff of the wrong shape; a Tucker-factored LoKr, which torch.kron cannot expand; and
        # OFT/BOFT in half-precision intermediates (their fp32 matrix inverse meets a half matrix). Our on-the-fly
        # patches therefore compute in fp32 (see test_streamed_and_resident_patches_agree_bit_for_bit).
        skipped = {"shape-mismatch", "lokr-tucker"} | ({"oft", "boft"} if dtype != torch.float32 else set())
        if name not in skipped:
            assert not torch.equal(ours, weight.to(dtype)), name
    assert "diff patch for shape-mismatch not applied" in caplog.text  # skipped with a warning naming the key


def test_model_as_lora_and_nested_patches_equal_comfyui(comfy):
    lora, _adapters, _patcher, _float = comfy
    torch.manual_seed(7)
    weight, base, target = torch.randn(6, 5), torch.randn(6, 5), torch.randn(6, 5)
    as_lora = [(0.5, ("model_as_lora", (target,)), 1.0, None, None)]
    originals = {"k": [(base,)]}
    assert torch.equal(
        calculate_weight(as_lora, weight.clone(), "k", original_weights=originals),
        lora.calculate_weight(as_lora, weight.clone(), "k", original_weights=originals),
    )
    nested = [
        (
            0.7,
            [(torch.randn(6, 5), lambda t, inplace: t * 2), (1.0, (torch.randn(6, 5),), 1.0, None, None)],
            1.0,
            None,
            None,
        )
    ]
    assert torch.equal(
        calculate_weight(nested, weight.clone(), "k"), lora.calculate_weight(nested, weight.clone(), "k")
    )


@pytest.fixture(scope="module")
def fp8_noise(comfy):
    """How the pack draws fp8 rounding noise on the running ComfyUI (with or without comfy-kitchen's rounding)."""
    from tools.runtime.inprocess import import_pack

    return importlib.import_module(f"{import_pack().__name__}.nodes.surface").fp8_rounding_noise()


def test_seeds_and_stochastic_fp8_rounding_equal_comfyui(comfy, fp8_noise):
    _lora, _adapters, patcher, comfy_float = comfy
    for key in ("diffusion_model.input_blocks.1.1.proj_in.weight", "x", ""):
        assert key_seed(key) == patcher.string_to_seed(key)
    torch.manual_seed(3)
    value = torch.randn(300, 70) * 3
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.bfloat16):
        ours = round_to(value, dtype, seed=1234, noise=fp8_noise)
        theirs = comfy_float.stochastic_rounding(value, dtype, seed=1234)
        assert ours.dtype == dtype and torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8)), dtype


def test_the_on_the_fly_patch_equals_comfyui_lowvram_patch(comfy, fp8_noise):
    _lora, adapters, patcher, _float = comfy
    weight, patches = cases(adapters)["lora"]
    table = {"w": patches}
    # ComfyUI 0.2x's LowVramPatch (the one with ``prepare``) computes an fp8 weight's patch in fp8 itself, with no
    # stochastic rounding; ours keeps the float32 math and the seeded rounding its resident weights get (a
    # streamed fp8 layer is computed as a resident one is), so it differs from that ComfyUI's streamed one.
    fp8 = () if hasattr(patcher.LowVramPatch, "prepare") else (torch.float8_e4m3fn,)
    for dtype in (torch.float32, torch.float16, *fp8):
        stored = weight.to(dtype)
        ours = OnTheFlyPatch("w", table, fp8_noise=fp8_noise)(stored.clone())
        theirs = patcher.LowVramPatch("w", table)(stored.clone())
        assert ours.dtype == theirs.dtype and torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8)), dtype


@pytest.fixture(scope="module")
def our_patcher(comfy):
    """Device Control's model patcher class, as ComfyUI loads the pack (the class users' models get)."""
    from tools.runtime.inprocess import import_pack

    return importlib.import_module(f"{import_pack().__name__}.nodes.bridge.patcher").DeviceControlPatcher


@pytest.fixture(scope="module")
def patch_error(comfy):
    """The error class the pack raises, as ComfyUI loads the pack."""
    from tools.runtime.inprocess import import_pack

    return importlib.import_module(f"{import_pack().__name__}.core.errors").PatchError


def layer_patcher(patcher_class, weight: torch.Tensor):
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    cpu = torch.device("cpu")
    return layer, patcher_class(layer, cpu, cpu)


@pytest.mark.parametrize("storage", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_streamed_and_resident_patches_agree_bit_for_bit(comfy, our_patcher, storage):
    """Through the patcher users' models get: patched resident, restored exactly, and patched on the fly."""
    _lora, adapters, _patcher, _float = comfy
    for name in ("lora", "oft", "loha"):
        weight, patches = cases(adapters)[name]
        layer, patcher = layer_patcher(our_patcher, weight.to(storage))
        stored = layer.weight.detach().clone()
        patcher.add_patches({"weight": patches[0][1]}, strength_patch=patches[0][0])
        patcher.patch_weight_to_device("weight")
        resident = layer.weight.detach().to(torch.float32)  # what a resident layer computes with
        patcher.unpatch_model()
        assert torch.equal(layer.weight.view(torch.uint8), stored.view(torch.uint8))  # restored bit for bit
        streamed = patcher.on_the_fly("weight", layer.weight)(stored.to(torch.float32))
        assert torch.equal(streamed, resident), (name, storage)


def test_a_patch_of_unknown_type_is_refused_when_added_naming_the_file_and_the_weight(our_patcher, patch_error):
    _layer, patcher = layer_patcher(our_patcher, torch.zeros(4, 4))

    def load_lora(lora_name: str) -> None:  # ComfyUI's LoRA loaders hold the file's name in this variable
        patcher.clone().add_patches({"weight": ("mystery", (torch.zeros(1),))})

    expected = r"LoRA 'odd\.safetensors', patch for weight: unknown patch type 'mystery'.*update that node pack"
    with pytest.raises(patch_error, match=expected):
        load_lora("loras/odd.safetensors")
    assert not patcher.patches  # nothing was added


def test_nan_in_a_patch_is_refused_when_added_naming_the_file_the_weight_and_the_lora_key(
    comfy, our_patcher, patch_error
):
    _lora, adapters, _patcher, _float = comfy
    _layer, patcher = layer_patcher(our_patcher, torch.zeros(4, 4))
    up, down = torch.zeros(4, 2), torch.full((2, 4), float("nan"))
    adapter = adapters.LoRAAdapter({"lora_unet_layer.lora_up.weight"}, (up, down, 1.0, None, None, None))

    def load_lora(lora_name: str) -> None:
        patcher.clone().add_patches({"weight": adapter, "text_model.other.weight": ("mystery", ())})

    expected = (
        r"LoRA 'nan\.safetensors' has NaN .* patch for weight \(LoRA key lora_unet_layer.*\): the file is damaged"
    )
    with pytest.raises(patch_error, match=expected):  # (the patch for a weight this model lacks is skipped)
        load_lora("nan.safetensors")


#: Patch types that need the whole weight (the layer streams whole): their norm or layout spans every row.
WHOLE_ONLY = {"lora-dora-full", "loha-cp", "glora", "glora-old", "boft"}
WHOLE_ONLY |= {"strength-model-offset-function", "shape-mismatch", "oft"}  # a function; a diff that does not fit;
# OFT with a norm bound (its alpha is 0.5 here)


@pytest.mark.parametrize("storage", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_row_slices_of_streamed_patches_equal_comfyuis_whole_patched_weight(comfy, storage):
    """A layer streamed in row slices patches each slice alone: every slice equals the same rows of ComfyUI's
    ``calculate_weight`` on the whole weight, with ComfyUI's own adapter classes; a patch that needs every row says
    so (its layer then streams whole)."""
    lora, adapters, _patcher, _float = comfy
    sliced = 0
    for name, (weight, patches) in cases(adapters).items():
        rows = torch.cat([weight] * 16)  # 384 or 256 rows: several 64-row slices, and 192-row ones for LoKr
        function = OnTheFlyPatch("w", {"w": _taller(patches, 16)}, storage_dtype=storage)
        multiple = function.slice_multiple(tuple(rows.shape))
        if name in WHOLE_ONLY:
            assert multiple is None, name
            continue
        assert multiple is not None, name
        stored = rows.to(storage)
        expected = lora.calculate_weight(_taller(patches, 16), stored.to(torch.float32, copy=True), "w").to(storage)
        for start, stop in row_slices(stored.shape[0], 1, 1, math.lcm(64, multiple)).ranges():
            got = function.rows(stored[start:stop].to(torch.float32), start, stop)
            assert torch.equal(got, expected[start:stop].to(torch.float32)), (name, start, stop)
        sliced += 1
    assert sliced >= 7


def _taller(patches: list, times: int) -> list:
    """``patches`` for a weight ``times`` as tall (each factor on the output side repeated), so it slices."""
    taller = []
    for strength, value, strength_model, offset, function in patches:
        name = getattr(value, "name", None)
        if name == "lora":
            up, down, alpha, mid, dora, reshape = value.weights
            grown = type(value)(set(), (torch.cat([up] * times), down, alpha, mid, _grow(dora, times), reshape))
        elif name == "loha":
            w1a, w1b, alpha, w2a, w2b, t1, t2, dora = value.weights
            grown = type(value)(
                set(), (torch.cat([w1a] * times), w1b, alpha, torch.cat([w2a] * times), w2b, t1, t2, dora)
            )
        elif name == "lokr" and value.weights[0] is not None:
            w1, *rest = value.weights
            grown = type(value)(set(), (torch.cat([w1] * times), *rest))
        elif isinstance(value, tuple) and value and isinstance(value[-1], tuple):
            grown = (value[0], (torch.cat([value[1][0]] * times), *value[1][1:]))
        elif isinstance(value, tuple) and len(value) == 1:
            grown = (torch.cat([value[0]] * times),)
        else:
            grown = value
        taller.append((strength, grown, strength_model, offset, function))
    return taller


def _grow(tensor: torch.Tensor | None, times: int) -> torch.Tensor | None:
    return tensor if tensor is None or tensor.shape[0] == 1 else torch.cat([tensor] * times)
