"""Intel GPUs (``torch.xpu``, built into torch): the CUDA-style module API, without host pinning."""

from __future__ import annotations

from .torch_module import TorchModuleBackend


class XpuBackend(TorchModuleBackend):
    """The ``xpu`` devices."""

    def __init__(self) -> None:
        super().__init__("xpu", "xpu")
