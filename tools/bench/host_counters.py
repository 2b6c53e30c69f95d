"""What ``tools/bench/host.py`` counts and times of the host's work: Python calls into chosen files (ours, or
ComfyUI's), and the time spent in the simulated backend's methods, taken out of our side's times."""

from __future__ import annotations

import inspect
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tools.runtime.provision import REPO


class Calls:
    """Python calls into files under ``roots`` (not under ``excluded``), counted by ``sys.setprofile``, each
    also booked to the outermost such function it ran under (``load``, ``cleanup``, a layer's ``forward``)."""

    def __init__(self, roots: tuple[str, ...], excluded: tuple[str, ...] = ()) -> None:
        self.roots, self.excluded = roots, excluded
        self.total = 0
        self.by_root: Counter[str] = Counter()
        self.by_function: Counter[str] = Counter()
        self._mine: dict[str, bool] = {}
        self._depth = 0
        self._inside_excluded = 0
        self._root = ""

    def _is_mine(self, filename: str) -> bool:
        mine = self._mine.get(filename)
        if mine is None:
            mine = filename.startswith(self.roots) and not filename.startswith(self.excluded)
            self._mine[filename] = mine
        return mine

    def _profile(self, frame: Any, event: str, _arg: Any) -> None:
        if event not in ("call", "return"):
            return
        code = frame.f_code
        if code.co_filename.startswith(self.excluded):  # and what it calls (e.g. a simulated tensor's shape)
            self._inside_excluded += 1 if event == "call" else -1
            return
        if self._inside_excluded > 0 or not self._is_mine(code.co_filename):
            return
        if event == "return":
            self._depth = max(0, self._depth - 1)
            return
        if self._depth == 0:
            self._root = code.co_name
        self._depth += 1
        self.total += 1
        self.by_root[self._root] += 1
        self.by_function[f"{Path(code.co_filename).name}:{code.co_name}"] += 1

    @contextmanager
    def counting(self) -> Iterator[Calls]:
        sys.setprofile(self._profile)
        try:
            yield self
        finally:
            sys.setprofile(None)


def pack_calls() -> Calls:
    """A counter of the pack's own calls (``core/``, ``nodes/``), the simulated backend's modules excluded."""
    devices = str(REPO / "core" / "devices")
    excluded = (f"{devices}/sim", f"{devices}/backends/simulated.py")
    return Calls((str(REPO / "core") + "/", str(REPO / "nodes") + "/"), excluded)


def comfy_calls(comfy_root: Path) -> Calls:
    return Calls((str(comfy_root / "comfy") + "/",))


class BackendTime:
    """Host time spent in the simulated backend's methods (its copies, streams, events and allocations): on a GPU
    that is a copy engine's and the driver's work, so our side's forward times are taken with it out. Its tensors'
    operations are not taken out (the computation, and the simulated device's bookkeeping of each): those cancel
    against the forward with every layer resident, except for the operations a streamed layer adds (a sliced layer's
    slices), which stay in our time as a GPU's kernel launches would."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._inside = False

    def _timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._inside:  # a method calling another: timed once, by the outer
                return method(*args, **kwargs)
            self._inside, started = True, time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self._inside = False

        return timed

    @contextmanager
    def watching(self, backend: type) -> Iterator[BackendTime]:
        """Time the methods of ``backend`` (the simulated backend's class) while in this context."""
        methods = {name: m for name, m in vars(backend).items() if inspect.isfunction(m) and not name.startswith("__")}
        for name, method in methods.items():
            setattr(backend, name, self._timed(method))
        try:
            yield self
        finally:
            for name, method in methods.items():
                setattr(backend, name, method)
