"""A test-only stand-in for PyAV (``av``), for a GPU machine whose Python has no PyAV and cannot install it.

ComfyUI's V3 node API (``comfy_api.latest``) imports ``av`` at start-up for its video input and output types, and
uses it only inside video functions. Nothing the benchmark or the GPU tests run touches video, so this module lets
the import succeed; any use of it fails with a message that says what happened. ``tools/gpu/session.sh`` puts its
folder last on ``PYTHONPATH`` (a real PyAV wins where there is one). It is never part of the pack.
"""

from __future__ import annotations

__version__ = "0.0.0+device-control-test-stand-in"


class Unavailable:
    """Any attribute chain of the stand-in (a class, a function, a constant); using it fails."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Unavailable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            f"{self._name} is not available: this GPU test machine stands in for PyAV, which is not installed "
            "there; video nodes cannot run."
        )

    def __mro_entries__(self, bases: tuple[object, ...]) -> tuple[type, ...]:
        return (object,)  # a class that names one of these as its base still defines


def stand_in(module: str, attr: str) -> Unavailable:
    """The stand-in for ``module.attr`` (what a submodule's ``__getattr__`` returns)."""
    if attr.startswith("__"):
        raise AttributeError(attr)
    return Unavailable(f"{module}.{attr}")


def __getattr__(attr: str) -> Unavailable:
    return stand_in("av", attr)
