"""The rings of one model, found from its root: given back when sampling ends, refilled when its weights are
rewritten.

Every ring a model streams through (its engine's, and a split model's one per donor device) registers with the
model's root when made (``core.placement.ring``), so that what the patcher does once or twice a step (ComfyUI's
cleanup at the end of sampling; its hooks, which rewrite weights in place between two calls of one step) finds them
in one lookup, not by walking every module of the model (thousands in a large UNet).
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch


class Ring(Protocol):
    """What is asked here of a ring (``core.placement.ring.Ring``; named by what it does, so that this module,
    which the ring imports, imports nothing of it)."""

    @property
    def ring_bytes(self) -> int: ...

    def settle(self) -> None: ...

    def forget_slots(self) -> None: ...


#: The attribute of a model's root that holds its rings (weakly: a ring a split left behind goes with its split).
RINGS = "device_control_rings"


def register(root: torch.nn.Module, ring: Ring) -> None:
    """``ring`` streams layers of ``root``."""
    rings = root.__dict__.get(RINGS)
    if rings is None:
        rings = root.__dict__[RINGS] = weakref.WeakSet()
    rings.add(ring)


def unregister(root: torch.nn.Module, ring: Ring) -> None:
    """``ring`` streams no layer of ``root`` any more."""
    rings = root.__dict__.get(RINGS)
    if rings is not None:
        rings.discard(ring)


def settle(root: torch.nn.Module) -> int:
    """Sampling with ``root`` ended: every ring over its layers waits for its copies and frees its slots. Bytes
    freed on devices. (Called at every sampling call, as :func:`before_rewrite` is at every hook change: the
    lookups are written out, a model that streams nothing costs no call.)"""
    freed = 0
    for ring in list(root.__dict__.get(RINGS, ())):  # a copy: a ring may go while the others settle
        freed += ring.ring_bytes
        ring.settle()
    return freed


def before_rewrite(root: torch.nn.Module) -> None:
    """ComfyUI is about to rewrite ``root``'s weights in place (its hooks, between two calls of one step): every
    ring waits for the copies that read them and forgets what its slots hold, keeping its slots and their views
    for the next call (a copy made before a weight was rewritten cannot be told from one made after)."""
    for ring in list(root.__dict__.get(RINGS, ())):
        ring.forget_slots()
