"""Framework-independent core of Device Control: torch, safetensors, psutil and the standard library only.

Nothing here imports ComfyUI, so these modules work on plain torch models and are tested without ComfyUI.
Modules import each other relatively, so the package works both as ``core`` (tests, command line) and inside
the pack when ComfyUI imports it from ``custom_nodes/``.
"""
