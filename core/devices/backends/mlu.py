"""Cambricon MLUs (``torch.mlu``, from the ``torch_mlu`` extension): the CUDA-style module API, without host pinning."""

from __future__ import annotations

from .torch_module import TorchModuleBackend


class MluBackend(TorchModuleBackend):
    """The ``mlu`` devices."""

    def __init__(self) -> None:
        super().__init__("mlu", "mlu")
