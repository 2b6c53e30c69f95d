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
from types import SimpleNamespace
from typing import Any

import torch

from ..host_memory import Platform, loaded_libraries, open_library, os_platform

#: This machine's own ``mmap`` module, as the host-memory module hands it out (the only module that speaks to the OS):
#: the simulated platforms' stand-ins are built over it.
_os_mmap = os_platform().mmap

PLATFORM_ENV = "DEVICE_CONTROL_SIMULATE_PLATFORM"

KiB = 1024


def _aligned_anonymous(length: int, granularity: int) -> memoryview:
    """``length`` bytes of a private anonymous mapping starting at a multiple of ``granularity`` (over-mapped and
    narrowed: this machine's mappings start on its own, smaller pages)."""
    private = _os_mmap.MAP_PRIVATE | _os_mmap.MAP_ANONYMOUS
    whole = _os_mmap.mmap(-1, length + granularity, flags=private)
    start = -_address(whole) % granularity
    return memoryview(whole)[start : start + length]


def _address(mapping: Any) -> int:
    return torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()


def windows_mmap(granularity: int = 64 * KiB) -> SimpleNamespace:
    """Windows' ``mmap`` module as far as the pack uses it: its signature ``mmap(fileno, length, tagname=None,
    access=ACCESS_DEFAULT, offset=0)``, its constants (no ``MAP_*``, ``PROT_*`` or ``MADV_*``, and mappings
    without ``madvise``: a mapped file's pages cannot be given back), 4 KiB pages and mappings at 64 KiB
    boundaries."""

    def mmap(
        fileno: int, length: int, tagname: str | None = None, access: int = _os_mmap.ACCESS_DEFAULT, offset: int = 0
    ) -> Any:
        if offset % granularity:
            raise OSError(87, "The parameter is incorrect (offset is not a multiple of the allocation granularity)")
        if fileno == -1:  # memory of the paging file, the process's own
            return _aligned_anonymous(length, granularity)
        return _os_mmap.mmap(fileno, length, access=access, offset=offset)

    return SimpleNamespace(
        mmap=mmap,
        PAGESIZE=4 * KiB,
        ALLOCATIONGRANULARITY=granularity,
        ACCESS_DEFAULT=_os_mmap.ACCESS_DEFAULT,
        ACCESS_READ=_os_mmap.ACCESS_READ,
        ACCESS_WRITE=_os_mmap.ACCESS_WRITE,
        ACCESS_COPY=_os_mmap.ACCESS_COPY,
        error=OSError,
    )


def unix_mmap(page: int) -> SimpleNamespace:
    """A Unix ``mmap`` module whose pages are ``page`` bytes: this machine's signature and constants (``MAP_ANON``
    beside ``MAP_ANONYMOUS``, as macOS's and Linux's have them), its mappings starting on such pages."""

    def mmap(fileno: int, length: int, flags: int = _os_mmap.MAP_SHARED, **keywords: Any) -> Any:
        if fileno == -1 and flags & _os_mmap.MAP_ANONYMOUS:
            return _aligned_anonymous(length, page)
        return _os_mmap.mmap(fileno, length, flags=flags, **keywords)

    names = [name for name in dir(_os_mmap) if name.isupper() and name not in ("PAGESIZE", "ALLOCATIONGRANULARITY")]
    constants = {name: getattr(_os_mmap, name) for name in names}
    return SimpleNamespace(mmap=mmap, PAGESIZE=page, ALLOCATIONGRANULARITY=page, error=OSError, **constants)


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
