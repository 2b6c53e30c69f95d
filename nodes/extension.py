"""The ComfyUI extension: the list of our nodes, handed to ComfyUI by ``comfy_entrypoint``."""

from __future__ import annotations

from .load_checkpoint import LoadCheckpointWithDevice
from .move_to_gpu import MoveToGPU
from .offload_to_cpu import OffloadToCPU
from .surface import ComfyExtension, io
from .vram_report import VRAMReport


class DeviceControlExtension(ComfyExtension):
    """Device Control's nodes."""

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [LoadCheckpointWithDevice, MoveToGPU, OffloadToCPU, VRAMReport]
