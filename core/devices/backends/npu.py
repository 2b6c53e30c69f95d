"""Huawei Ascend NPUs (``torch.npu``, from the ``torch_npu`` extension): the CUDA-style API, without pinning."""

from __future__ import annotations

from .torch_module import TorchModuleBackend


class NpuBackend(TorchModuleBackend):
    """The ``npu`` devices."""

    def __init__(self) -> None:
        super().__init__("npu", "npu")
