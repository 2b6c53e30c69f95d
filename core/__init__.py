"""Framework-independent core of Device Control: torch, safetensors, psutil and the standard library only.

Nothing here imports ComfyUI, so these modules work on plain torch models and are tested without ComfyUI.
Modules import each other relatively, so the package works both as ``core`` (tests, command line) and inside
the pack when ComfyUI imports it from ``custom_nodes/``.

Packages, by concern, with imports going one way only (``tests/core/test_structure.py`` checks it):
``devices`` (probes, inventory, the simulated GPU, moving tensors) is at the bottom; ``weights`` (cast layers and
patches) and ``detection`` (what a file is) use it or nothing; ``files`` (reading a file into models) uses
``detection``; ``placement`` (budgets, fit, plans, the loading engine, eviction) uses ``devices`` and
``detection``; ``monitor`` (the memory report, the panel's push) uses ``devices``. ``errors`` and ``units`` are
shared by all.
"""
