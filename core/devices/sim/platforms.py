"""Simulated platforms: Windows, 64 KiB-page arm64 Linux and macOS, on the x86-64 Linux machines the tests run on.

As the simulated GPU is a device behind the backend interface, a simulated platform is a
:class:`~core.devices.host_memory.Platform` behind the host-memory module: the pack sees that OS's surface as far
as it touches it, and the engine runs unchanged. ``DEVICE_CONTROL_SIMULATE_PLATFORM`` chooses one for a process
(the core tier and a ComfyUI server in CI); :func:`simulated_platform` makes one for a test.

* ``windows``: Windows' ``mmap`` (no Unix flags: ``flags=`` and ``prot=`` are refused as Windows' Python refuses
  them; mappings start at its 64 KiB allocation granularity; no ``madvise``, so a mapped file's pages cannot be
  given back), no ``/proc`` (loaded libraries come
  from the module list: the CUDA runtime is a ``cudart64_*.dll``), and a driver that refuses page-locking past
  about half of RAM.
* ``linux-64k``: pages of 64 KiB (arm64 kernels built so, as on Grace-based servers): host registration locks
  64 KiB at a time, and the OS's mappings start on such pages.
* ``macos``: pages of 16 KiB, no ``/proc``, no CUDA runtime, and unified memory: a simulated GPU is like MPS
  (nothing to page-lock, no streams or events).

Only the mappings' placement and signatures are simulated: the memory itself is this machine's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..host_memory import KiB, Platform, loaded_libraries, open_library, unix_mmap, windows_mmap

PLATFORM_ENV = "DEVICE_CONTROL_SIMULATE_PLATFORM"


def simulated_platform(name: str, *, ram: int | None = None, libraries: Mapping[str, Any] | None = None) -> Platform:
    """The simulated platform ``name`` (:data:`PROFILES`); ``ram``: the RAM it reports (the driver's limit is a share
    of it); ``libraries``: the shared libraries loaded, by path, with their functions (Windows and macOS, which
    have no ``/proc``: none by default)."""
    loaded = dict(libraries or {})

    def listed() -> list[str]:
        return sorted(loaded)

    def opened(path: str) -> Any:
        if path not in loaded:
            raise OSError(f"{path} is not loaded")
        return loaded[path]

    if name == "windows":
        windows = windows_mmap()
        return Platform("windows", windows, 4 * KiB, listed, opened, registration_limit=0.5, nvml="nvml.dll", ram=ram)
    if name == "linux-64k":
        linux = unix_mmap(64 * KiB)
        return Platform("linux-64k", linux, 64 * KiB, loaded_libraries, open_library, nvml="libnvidia-ml.so.1", ram=ram)
    if name == "macos":
        return Platform(
            "macos",
            unix_mmap(16 * KiB),
            16 * KiB,
            listed,
            opened,
            unified_memory=True,
            ram=ram,
        )
    raise ValueError(f"no simulated platform {name!r}; choose one of {', '.join(PROFILES)}")


#: The simulated platforms, by the name :data:`PLATFORM_ENV` takes.
PROFILES = ("windows", "linux-64k", "macos")


def platform_from_env(environ: Mapping[str, str] | None = None) -> Platform | None:
    """The platform :data:`PLATFORM_ENV` asks for; ``None`` when it is unset (this machine's own).

    Raises:
        ValueError: it names no simulated platform (the message lists them).
    """
    text = (os.environ if environ is None else environ).get(PLATFORM_ENV, "").strip().lower()
    return simulated_platform(text) if text else None
