"""The end of one use of a model: the moment none of its modules is computing any more.

A model run once each time it is used (a text encoder, a VAE) is not sampled, so nothing tells its ring that a
use ended; counting its layers does not either (a VAE decodes with its decoder only, and runs ``post_quant_conv``,
registered last, first). So the ring watches the model itself: a hook before and after the forward of the root and
of each of its children keeps a depth, and when it comes back to zero the use is over. A use made of several
calls of its children (a VAE's ``decode``: ``post_quant_conv``, then the decoder) is one use: the root's
:data:`USE_METHODS` count as a call too, so the use ends when the method returns, not when its first child does
(else the ring learned its order from ``post_quant_conv`` alone, and was freed and allocated again between the
two). An exception leaving a forward or a method counts as its end too.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

#: The methods other than ``forward`` by which a model is used, each a use made of several calls of its children:
#: ComfyUI's VAEs (``AutoencoderKL``, Wan's and the others') decode and encode through them, and its text encoders
#: encode through ``encode_token_weights`` (SDXL's: CLIP-L, then CLIP-G).
USE_METHODS = ("decode", "encode", "encode_token_weights")


class UseWatch:
    """Calls ``on_end`` each time the computation of a watched module tree ends."""

    def __init__(self, on_end: Callable[[], None]) -> None:
        self._on_end = on_end
        self._depth = 0
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._spanned: list[tuple[torch.nn.Module, str, partial]] = []

    def watch(self, root: torch.nn.Module) -> None:
        """Watch ``root`` and its children (what a model's own methods call), looking through lists and dicts of
        modules, which are never called themselves, and ``root``'s :data:`USE_METHODS` where its class has them
        (an attribute of the instance that calls the class's method: a copy of the model binds its own)."""
        self.unwatch()
        for module in _called(root):
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))
        for name in USE_METHODS:
            method = getattr(type(root), name, None)
            if callable(method) and name not in root.__dict__:
                spanning = partial(_one_use, self, method, root)
                root.__dict__[name] = spanning
                self._spanned.append((root, name, spanning))

    def unwatch(self) -> None:
        """Stop watching."""
        for handle in self._handles:
            handle.remove()
        for root, name, spanning in self._spanned:
            if root.__dict__.get(name) is spanning:
                del root.__dict__[name]
        self._handles, self._spanned, self._depth = [], [], 0

    def _enter(self, _module: torch.nn.Module, _args: object) -> None:
        self._depth += 1

    def _leave(self, _module: torch.nn.Module, _args: object, _output: object) -> None:
        self._depth = max(0, self._depth - 1)
        if not self._depth:
            self._on_end()


def _one_use(watch: UseWatch, method: Callable[..., Any], root: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``root``'s ``method`` called as one use: the children it calls do not end the use."""
    watch._enter(root, args)
    try:
        return method(root, *args, **kwargs)
    finally:
        watch._leave(root, args, None)


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
