"""The end of one use of a model: the moment none of its modules is computing any more.

A model run once each time it is used (a text encoder, a VAE) is not sampled, so nothing tells its ring that a
use ended; counting its layers does not either (a VAE decodes with its decoder only, and runs ``post_quant_conv``,
registered last, first). So the ring watches the model itself: a hook before and after the forward of the root and
of each of its children keeps a depth, and when it comes back to zero, whichever method of the model was called
(``forward``, ``decode``, ``encode``), the use is over. An exception leaving a forward counts as its end too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class UseWatch:
    """Calls ``on_end`` each time the computation of a watched module tree ends."""

    def __init__(self, on_end: Callable[[], None]) -> None:
        self._on_end = on_end
        self._depth = 0
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def watch(self, root: torch.nn.Module) -> None:
        """Watch ``root`` and its children (what a model's own methods call), looking through lists and dicts of
        modules, which are never called themselves."""
        self.unwatch()
        for module in _called(root):
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))

    def unwatch(self) -> None:
        """Stop watching."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._depth = [], 0

    def _enter(self, _module: torch.nn.Module, _args: object) -> None:
        self._depth += 1

    def _leave(self, _module: torch.nn.Module, _args: object, _output: object) -> None:
        self._depth = max(0, self._depth - 1)
        if not self._depth:
            self._on_end()


def _called(root: torch.nn.Module) -> list[torch.nn.Module]:
    """``root`` and the modules its own methods call: its children, those of a list or dict of modules in its
    place."""
    found, waiting = [root], list(root.children())
    while waiting:
        module = waiting.pop(0)
        if isinstance(module, torch.nn.ModuleList | torch.nn.ModuleDict):
            waiting.extend(module.children())
        else:
            found.append(module)
    return found
