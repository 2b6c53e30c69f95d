"""Whether this machine's matrix library computes a linear layer's rows alike whole and cut into row slices.

Bit-exact streaming in row slices rests on it (docs/how-it-works.md, "How partial loading works"): a slice's output
elements must come out as the whole layer's do. Libraries choose their kernels by shape, and some choose, for a
narrower output, one that sums in another order: Intel's MKL on an AVX-512 Xeon computes 16 tokens by 2048 inputs
into 512 outputs otherwise than into 128-row slices of them (the last bit of some elements), where on an AMD EPYC it
does not. On such a machine a sliced model cannot give ComfyUI's result bit for bit, and the tests that compare a
sliced model with ComfyUI's whole one compare within float32 rounding instead, saying why.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

#: (tokens, inputs, outputs) of layers the tests slice: a DiT's MLP, SD1.5's attention and feed-forward widths.
SHAPES = ((16, 2048, 512), (1, 2048, 512), (64, 1280, 1280), (154, 768, 3072), (256, 320, 1280))
#: Rows per slice tried (multiples of 64, as the engine cuts).
ROWS = (64, 128, 256)
#: Where slices are not exact here: the relative and absolute tolerance of a comparison of final outputs
#: (latents after sampling; decoded images compare within one level of 255).
RTOL, ATOL = 1e-4, 1e-4


@functools.cache
def slices_exact() -> bool:
    """Whether every probed shape computes alike whole and in row slices on this machine."""
    generator = torch.Generator().manual_seed(0)
    for tokens, inputs, outputs in SHAPES:
        x = torch.randn(tokens, inputs, generator=generator)
        weight = torch.randn(outputs, inputs, generator=generator)
        whole = torch.nn.functional.linear(x, weight)
        for rows in ROWS:
            parts = [torch.nn.functional.linear(x, weight[i : i + rows].clone()) for i in range(0, outputs, rows)]
            if not torch.equal(whole, torch.cat(parts, -1)):
                return False
    return True


def same_result(ours: np.ndarray | torch.Tensor, theirs: np.ndarray | torch.Tensor) -> bool:
    """``ours`` equals ``theirs`` bit for bit, or, where this machine computes slices otherwise than the whole,
    within float32 rounding (images within one level)."""
    a, b = np.asarray(ours), np.asarray(theirs)
    if slices_exact() or a.shape != b.shape:
        return bool(np.array_equal(a, b))
    if np.issubdtype(a.dtype, np.integer):  # decoded images, 0 to 255
        return int(np.abs(a.astype(np.int32) - b.astype(np.int32)).max(initial=0)) <= 1
    return bool(np.allclose(a, b, rtol=RTOL, atol=ATOL))
