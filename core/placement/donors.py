"""A split model in ``stream`` mode: one device computes, the others (*donors*: another GPU, the CPU) hold the rest
of the model and stream it to the computing device as each layer is reached, the next layers copied ahead while
the current one computes.

It is the streaming a budget already does (``core.placement.streaming``: a layer casts its weights to the input's
device on each use), with the weights kept on the donor instead of in RAM: a second GPU's memory holds what does
not fit on the first, and its copies cross the link between them. :func:`place_streamed` puts every part on its
device and marks the donors' layers to stream to the computing one through a ring per donor (``core.placement.ring``:
their weights packed in slabs on the donor, a group copied ahead while the previous one computes).
Only the pack's own cast layers (``core.weights.ops``, marked ``CASTS_ANYWHERE``) stream from a donor: their copy
goes through the device's backend, which knows where the weight is on every kind of device. A host application's
layers cast with their own code (ComfyUI's ``cast_to`` compares torch devices, and a simulated GPU's tensors all
report the host's), and a layer that cannot stream at all lacks the cast protocol: both compute on the computing
device, so they are moved there whatever their part. They are the small ones (norms, embeddings' odd layers).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..devices.memory import free_bytes
from ..devices.tensors import Target, move_own, own_tensors
from ..devices.transfer import CASTS_ANYWHERE
from .pipeline import place_split
from .plan import STREAM_COPIES, Layer
from .ring import Ring
from .slabs import carried_bytes
from .split import ACTIVATIONS, Split
from .streaming import NO_HOOKS, LayerHooks, stream

#: Room on the computing device for the streamed copies, in copies of the largest streamed layer: twice the
#: budget's streaming reserve (``core.placement.plan.STREAM_COPIES``), where the device has it free beside its
#: part and what the host keeps free for its computation (never less than that reserve). Donors stream a large
#: share of a model every step, and a model's layers are not all alike: where large layers that compute little
#: come together (a UNet's low-resolution blocks), the link must be well ahead when they are reached, or the
#: computation waits for it. Room alone does not do it: the link must also keep copying where a step ends (the
#: prefetch wraps to the next step's first layers). At 7 GB/s, where the copies take about as long as the
#: computation, the two together brought ``stream`` from about 1.25x its floor to about 1.1x; either alone, or
#: more room than six copies, gained little (``docs/bench/split.md``).
DONOR_COPIES = 6


@dataclass
class Streamed:
    """What :func:`place_streamed` did: the layers streamed from donors, the layers that cannot stream and came
    to the computing device from a donor's part, the rings the streamed ones cross through (one per donor), and the
    room they were given on the computing device."""

    layers: list[Layer]
    moved_in: list[Layer]
    rings: list[Ring]
    reserve_bytes: int

    def release(self) -> None:
        """Stop streaming through the rings, waiting for their copies (before the layers move again)."""
        for ring in self.rings:
            ring.detach()


def stream_room(split: Split) -> int:
    """Room the computing device (the first part's) should have for streamed copies: ``DONOR_COPIES`` of the
    largest layer the other parts hold (the most :func:`place_streamed` takes). Known before anything moves, so
    room can be made for it with the part."""
    donated = (_carried(layer) for part in split.parts[1:] for block in part.blocks for layer in block.layers)
    return DONOR_COPIES * max(donated, default=0)


def _carried(layer: Layer) -> int:
    """The bytes a donor's layer takes in a ring slot (its tensors aligned as in its slab), at least its own (a
    layer whose cast is its own copies its tensors as they are)."""
    return max(layer.nbytes, carried_bytes(layer.module))


def place_streamed(
    split: Split,
    targets: Mapping[str, Target],
    compute: str,
    hooks: LayerHooks = NO_HOOKS,
    keep_free: int = ACTIVATIONS,
    *,
    root: torch.nn.Module,
    wraps: bool = True,
) -> Streamed:
    """Put each part of ``split`` on its device (``targets`` by device name) and stream the donors' layers to
    ``compute`` (the name of the computing device), through rings within ``DONOR_COPIES`` of the largest where
    the device has them free beside ``keep_free`` bytes for the computation (``STREAM_COPIES`` at least). ``root``:
    the model, whose rings the end of sampling gives back (``core.placement.rings``), watched for the end of a use
    when it does not ``wraps`` (see :class:`Ring`).

    Raises:
        torch.OutOfMemoryError: a device had no room (the layers moved so far stay where they went).
    """
    place_split(split, targets)
    target = targets[compute]
    streamed, moved_in, by_donor = [], [], {}
    for part in split.parts:
        if str(part.device) == compute:
            continue
        for block in part.blocks:
            for layer in block.layers:
                if layer.streamable and getattr(layer.module, CASTS_ANYWHERE, False):
                    stream(layer, target, hooks)
                    streamed.append(layer)
                    by_donor.setdefault(str(part.device), []).append(layer.module)
                else:
                    for name, _tensor, _is_param in list(own_tensors(layer.module)):
                        move_own(layer.module, name, target)
                    moved_in.append(layer)
    largest = max((_carried(layer) for layer in streamed), default=0)
    room = max(STREAM_COPIES * largest, min(DONOR_COPIES * largest, free_bytes(target) - keep_free))
    rings = []
    for modules in by_donor.values():  # the room less the layer computing (its cast), shared by the donors' rings
        ring = Ring(root)
        ring.wraps = wraps
        ring.attach(modules, target, (room - largest) // len(by_donor))
        rings.append(ring)
    return Streamed(streamed, moved_in, rings, room)
