"""A test-only stand-in for torchaudio, on the import path of the ComfyUI 0.28 and 0.33 test runtimes only.

ComfyUI 0.28 imports torchaudio at start-up (its audio VAE module, which ``comfy/sd.py`` imports), but uses it
only inside audio functions. The newest torchaudio on the package index (2.11) does not load beside the
runtime's torch 2.14, and a second torch just for one ComfyUI would cost gigabytes per test run. Nothing this
pack does touches audio, so the test runtime gives ComfyUI this module instead: importing it works, and any
use of it fails with a message that says what happened. It is never part of the pack or of a user's install.
"""

from __future__ import annotations

__version__ = "0.0.0+device-control-test-stand-in"


class _Unavailable:
    """Any attribute chain of the stand-in; calling it (or using it in a way that needs torchaudio) fails."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Unavailable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            f"{self._name} is not available: this ComfyUI test runtime stands in for torchaudio, which does "
            "not load beside its torch; audio nodes cannot run here."
        )


def __getattr__(attr: str) -> _Unavailable:
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Unavailable(f"torchaudio.{attr}")
