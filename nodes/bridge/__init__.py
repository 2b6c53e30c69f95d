"""The only place that touches ComfyUI's model objects (ModelPatcher, LoadedModel, CLIP, VAE, model configs).

``subjects`` tells a MODEL, CLIP and VAE apart and names them; ``reading`` describes what ComfyUI has loaded;
``checkpoint`` builds a checkpoint's models with ComfyUI's
classes and fills them our way; ``patcher`` loads and unloads models with ``core.placement`` under their
placement, through ComfyUI's own entry points; ``books`` sees ComfyUI's list of loaded models as the models
``core.placement`` can evict, and keeps models resident; ``moves`` is Move To GPU and Offload To CPU; ``pinning``
keeps ComfyUI's page-locked memory and ours in one set of books.
"""

from .pinning import count_comfyuis_registrations, pinning_notes
from .reading import device_id, loaded_models, memory_mode, residency_of
from .subjects import component_of, subject_of

__all__ = [
    "component_of",
    "count_comfyuis_registrations",
    "device_id",
    "loaded_models",
    "memory_mode",
    "pinning_notes",
    "residency_of",
    "subject_of",
]
