"""The ComfyUI side of Device Control: thin V3 nodes that call ``core``.

Only this package touches ComfyUI, and within it only ``surface.py`` imports ComfyUI modules.
"""
