"""What a tensor takes from a GPU's caching allocator: its bytes in the allocator's block, at most.

CUDA's caching allocator (ROCm's is the same code) never hands a tensor its exact bytes. A request is rounded up to
whole 512-byte units and cut from a segment: one of at most 1 MiB from the small pool's 2 MiB segments, split at any
unit; a larger one from the large pool (20 MiB segments, or a segment of its own, in 2 MiB units, from 10 MiB up),
where the rest of the segment is split off only when more than 1 MiB of it is left: a large block may keep up to
1 MiB more than its units. A 1.5 MB temporary can so take 2.5 MiB of the device.

:func:`block_bytes` is that bound. Room kept on a device for temporaries (a quantised weight's decode:
``core.weights.ggml_blocks.decode_bytes``) counts them so, and the simulated GPU books every tensor so in its
``reserved`` figure (``core.devices.sim.device``): a reserve counted in exact bytes fails there as it can on the
device. The free parts of segments the allocator keeps cached between uses are not a tensor's and are not counted
here: on a real GPU they were 118-309 MiB at the peak of a streamed run (``docs/bench/gpu.md``).
"""

from __future__ import annotations

#: Every block is a whole number of these bytes.
BLOCK_UNIT = 512
#: Blocks of at most this many bytes come from the small pool and take exactly their units.
SMALL_BLOCK = 1 << 20
#: The most a larger block keeps beyond its units: a segment's rest that is not split off.
LARGE_SLACK = 1 << 20


def block_bytes(nbytes: int) -> int:
    """The most device bytes a tensor of ``nbytes`` takes from a caching allocator (none for an empty one)."""
    if nbytes <= 0:
        return 0
    units = -(-nbytes // BLOCK_UNIT) * BLOCK_UNIT
    return units if nbytes <= SMALL_BLOCK else units + LARGE_SLACK
