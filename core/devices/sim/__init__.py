"""The simulated machine parts that let CI see what breaks on hardware and operating systems it does not have.

The simulated GPU: ``device`` (:class:`~.device.SimulatedDevice`: memory books, allocation, faults), ``tensor``
(tensors that live on it, computed on the host), ``link`` (its streams, events, copies that cost what a real link's
do, and the device's clock for its computations), ``slots`` (the buffers a streaming ring fills), ``host`` (host
memory a queued copy still reads), ``cost`` (what a copy and the host's work cost) and ``spec`` (the
``DEVICE_CONTROL_SIMULATE_*`` settings that make the devices). Production code drives it through the backend
interface only (``core.devices.backends.simulated``): nothing else names it (``tests/core/test_one_device_model.py``).
The simulated operating systems: ``platforms`` (Windows, 64 KiB-page arm64 Linux, macOS behind
``core.devices.host_memory``).
"""
