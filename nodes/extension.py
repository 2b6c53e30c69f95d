"""The ComfyUI extension: the list of our nodes, handed to ComfyUI by ``comfy_entrypoint``."""

from __future__ import annotations

from .bridge import count_comfyuis_registrations
from .load_checkpoint import LoadCheckpointWithDevice
from .load_diffusion_model import LoadDiffusionModelWithDevice
from .load_model_types import LoadCLIPVisionWithDevice, LoadControlNetWithDevice, LoadModelPatchWithDevice
from .load_text_encoders import LoadTextEncodersWithDevice
from .load_vae import LoadVAEWithDevice
from .move_to_gpu import MoveToGPU
from .offload_to_cpu import OffloadToCPU
from .panel import register_routes
from .profiling import install as install_profiling
from .queue_check import install as install_queue_check
from .split_model import SplitModel
from .surface import ComfyExtension, io
from .template_list import install as install_template_order
from .upscale_image import UpscaleImageWithDevice
from .vram_report import VRAMReport


class DeviceControlExtension(ComfyExtension):
    """Device Control's nodes, the routes of its live panel, the queue-time check of its nodes' values, the order of
    its templates, the profile's listener and route, and ComfyUI's pinned-memory books counted in ours.

    The routes are added when ComfyUI asks for the node list: ComfyUI 0.3.75 defines ``on_load`` but never
    calls it, and the list is asked for after the server exists and before it adds its routes.
    """

    async def on_load(self) -> None:
        _install()

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        _install()
        return list(NODES)


#: Our nodes, in the order the editor lists them.
NODES: tuple[type[io.ComfyNode], ...] = (
    LoadCheckpointWithDevice,
    LoadDiffusionModelWithDevice,
    LoadTextEncodersWithDevice,
    LoadVAEWithDevice,
    LoadControlNetWithDevice,
    LoadCLIPVisionWithDevice,
    LoadModelPatchWithDevice,
    MoveToGPU,
    OffloadToCPU,
    VRAMReport,
    SplitModel,
    UpscaleImageWithDevice,
)


def _install() -> None:
    """What the pack adds to ComfyUI's server and books, each once: the panel's routes, the queue-time check of
    our nodes' values, the order of our templates, the profile's listener, ComfyUI's pinned memory counted in
    ours."""
    register_routes()
    install_queue_check(NODES)
    install_template_order()
    install_profiling()
    count_comfyuis_registrations()
