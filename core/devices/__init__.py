"""Devices: what each one is and holds, and moving tensors to and from it.

``backends`` holds one module per kind of device (CUDA/ROCm, XPU, NPU, MLU, MPS, DirectML, the host, the simulated
GPU), each implementing one interface (identity, memory, moves, streams and events, pinning); ``backend_of(target)``
is how the rest of the product talks to a device. ``inventory`` numbers the devices (``gpu:N``), resolves device
strings; ``sim`` is the simulated machine (the simulated GPU: its device, tensors, link, streams and costs, and the
settings that make it, reached through ``backends`` only; the simulated operating systems); ``memory`` answers what
is free on one target; ``tensors`` moves one module's tensors in place and counts the bytes moved; ``transfer``
copies a streamed weight to where it computes (side streams, events, pinning); ``marks`` marks weights that stream.
Nothing here imports another package of ``core`` but ``errors`` and ``units``.
"""
