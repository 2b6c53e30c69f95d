"""The stand-in's ``torchaudio.functional``: ComfyUI 0.33 imports it at start-up (its Gemma 4 text encoder,
through ``comfy/sd.py``) and uses it only when it encodes audio. See the package's docstring."""

from __future__ import annotations

from . import _Unavailable


def __getattr__(attr: str) -> _Unavailable:
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Unavailable(f"torchaudio.functional.{attr}")
