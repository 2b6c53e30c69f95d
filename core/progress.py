"""How long loops report progress, and how a user's cancel reaches them without ``core`` knowing the host.

A :data:`ProgressCallback` is called with ``(done, total)`` after each step of a long loop (a tensor read, a
layer moved). It may raise to stop the loop there: inside ComfyUI the nodes pass one that raises ComfyUI's
own interruption, so Cancel stops a load or a move between two steps, and the loop leaves a consistent state.
"""

from __future__ import annotations

from collections.abc import Callable

ProgressCallback = Callable[[int, int], None]
