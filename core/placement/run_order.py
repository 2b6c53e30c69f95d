"""The order a model's streamed layers run in, learned on its first pass through a ring.

Models register their layers in one order and run them in another (a transformer block registers attn1, ff, attn2
and its norms, and runs norm1, attn1, norm2, attn2, norm3, ff). Groups packed in registration order then cross
more than once a pass (SD1.5's UNet: 79 group copies for 48 groups). So the first pass is watched layer by layer,
until a layer comes again or the model's use ends, and the ring packs its groups again in that order, once. The
order is kept for the next plans, which group in it from the start.
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
