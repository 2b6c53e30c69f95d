"""Weights in use: layers that cast their weights on the fly (``ops``), and patches applied to weights
(``patch_math`` for the math of every patch type, ``patching`` for applying, rounding and restoring them), and
GGML's quantised blocks turned back into floats (``ggml_blocks``).

One implementation each, used by Device Control's own models and by the models ComfyUI builds alike.
"""
