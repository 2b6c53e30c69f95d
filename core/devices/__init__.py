"""Devices: what each one is and holds, and moving tensors to and from it.

``backends`` probes every accelerator torch can drive (CUDA/ROCm, XPU, NPU, MLU, MPS, DirectML) and the host;
``inventory`` numbers them (``gpu:N``), resolves device strings and adds simulated GPUs; ``simulated`` is the
simulated GPU (``simtensor`` its tensors); ``memory`` answers what is free on one target; ``tensors`` moves one
module's tensors in place; ``transfer`` copies a streamed weight to where it computes (side streams, pinning).
Nothing here imports another package of ``core`` but ``errors`` and ``units``.
"""
