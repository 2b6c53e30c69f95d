"""The order a model's streamed layers run in: learned on its first pass through a ring, and from then on, what
follows each of the ring's groups.

Models register their layers in one order and run them in another (a transformer block registers attn1, ff, attn2
and its norms, and runs norm1, attn1, norm2, attn2, norm3, ff). Groups packed in registration order then cross
more than once a pass (SD1.5's UNet: 79 group copies for 48 groups). So the first pass is watched layer by layer,
until a layer comes again or the model's use ends, and the ring packs its groups again in that order, once
(:class:`RunOrder`). The order is kept for the next plans, which group in it from the start.

Which group follows which (:class:`Successors`) is what the ring copies ahead: a sampler's model wraps from a step's
last group to the next step's first; a model run once per use stops where its use ends.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class RunOrder:
    """What one ring learned of its model's run order."""

    def __init__(self) -> None:
        self._rank: dict[int, int] = {}  # id of a layer -> its place in the order learned
        self._run: dict[int, torch.nn.Module] = {}  # the layers of the pass being watched, in the order they ran
        #: Whether a pass is being watched (some streamed layer's place is not known).
        self.learning = False

    def sort(self, modules: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
        """``modules`` in the order learned (those not known yet after, in their order); watch the next pass if
        some are not known."""
        known = len(self._rank)
        order = sorted(range(len(modules)), key=lambda i: (self._rank.get(id(modules[i]), known), i))
        self.learning, self._run = any(id(module) not in self._rank for module in modules), {}
        return [modules[i] for i in order]

    def note(self, module: torch.nn.Module) -> bool:
        """``module`` computes; ``True`` when it ran already in the pass watched (the pass ended)."""
        if id(module) in self._run:
            return True
        self._run[id(module)] = module
        return False

    @property
    def watched(self) -> bool:
        """Whether the pass watched ran any layer yet."""
        return bool(self._run)

    def learn(self, packed: Sequence[torch.nn.Module]) -> list[torch.nn.Module] | None:
        """Keep the order the watched pass ran in (the layers it did not run after, in their ``packed`` order) and
        stop watching; that order when it is not ``packed``'s, else ``None``."""
        order = list(self._run.values()) + [module for module in packed if id(module) not in self._run]
        self._rank = {id(module): place for place, module in enumerate(order)}
        self.learning, self._run = False, {}
        same = [id(module) for module in order] == [id(module) for module in packed]
        return None if same else order

    def stop(self) -> None:
        """Stop watching (the ring is detached), keeping what was learned."""
        self.learning, self._run = False, {}


class Successors:
    """What follows each group of a ring: the groups its prefetch window copies ahead of the one computing."""

    def __init__(self) -> None:
        self._next: list[int | None] = []
        self._once: dict[int, int | None] = {}  # a group followed once by another than its next (:meth:`followed`)
        self._windows: dict[int, list[int]] = {}  # each group's window (:meth:`window`), until the order changes

    def reset(self, groups: int, wraps: bool) -> None:
        """A new plan's ``groups``, in the order they were packed: each followed by the next, the last by the first
        where the model ``wraps`` (a sampler's next step), else by nothing."""
        self._next = [*range(1, groups), 0 if wraps else None]
        self._once, self._windows = {}, {}

    def wrap(self, wraps: bool) -> None:
        """Whether the last group is followed by the first (see :meth:`reset`)."""
        following = 0 if wraps else None
        if self._next and self._next[-1] != following:  # said at every load: the windows change only with it
            self._next[-1] = following
            self._windows.clear()

    def expects(self, previous: int) -> int | None:
        """The group expected after ``previous`` (``None``: the use ends there)."""
        return self._next[previous]

    def followed(self, previous: int, group: int | None) -> None:
        """``group`` came after ``previous`` (``None``: the use ended there). A change is learned when it comes
        twice in a row: a move seen once is not the new order (skip-layer guidance leaves blocks out in one of a
        step's two calls, and learning each call's order in turn made both copy a group when reached). Only the
        windows through ``previous`` change. (A model run once per use starts each use with no group before, so a
        move back within a use is learned as any other.)"""
        if self._next[previous] == group:
            if self._once and previous in self._once:  # the order expected came back: the move seen once was not it
                del self._once[previous]
            return
        if previous not in self._once or self._once[previous] != group:
            self._once[previous] = group
            return
        del self._once[previous]
        self._next[previous] = group
        self._windows = {first: window for first, window in self._windows.items() if previous not in window}

    def enter(self, previous: int | None, group: int, slots: int) -> list[int]:
        """``group`` is entered after ``previous`` (``None``: first of its use): :meth:`followed` where it is not
        the group expected, and :meth:`window`. One call for the two where the order holds (a group's entry on a
        streamed pass makes as few Python calls as it can)."""
        if previous is not None and (self._next[previous] != group or previous in self._once):
            self.followed(previous, group)
        return self._windows.get(group) or self.window(group, slots)

    def window(self, group: int, slots: int) -> list[int]:
        """``group`` and the groups expected after it, ``slots`` at most (kept until the order or the number of
        slots changes: a group's entry then takes a lookup)."""
        window = self._windows.get(group)
        if window is not None:
            return window
        window = [group]
        following = self._next[group]
        while following is not None and len(window) < slots and following not in window:
            window.append(following)
            following = self._next[following]
        self._windows[group] = window
        return window

    def new_slots(self) -> None:
        """The ring has another number of slots: the windows are made again."""
        self._windows.clear()
