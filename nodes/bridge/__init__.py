"""The only place that touches ComfyUI's model objects (ModelPatcher, LoadedModel, CLIP, VAE, model configs).

``reading`` describes what ComfyUI has loaded; ``checkpoint`` builds a checkpoint's models with ComfyUI's
classes and fills them our way; ``patcher`` keeps our placements through ComfyUI's own loading.
"""

from .reading import component_of, device_id, loaded_models, memory_mode, patcher_of, residency_of

__all__ = ["component_of", "device_id", "loaded_models", "memory_mode", "patcher_of", "residency_of"]
