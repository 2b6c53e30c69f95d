"""Host memory as the operating system gives it: the one module of the pack that speaks to the OS.

Everything that differs between Windows, Linux (4 KiB or 64 KiB pages) and macOS lives here, so that the engine
runs the same code everywhere and the OS can be simulated in tests (``core.devices.sim.platforms``):

* **The platform** (:class:`Platform`): the page size (read from the OS, never assumed), its ``mmap`` module as it
  is there (Windows' has no Unix flags and another signature), the shared libraries loaded in this process (how a
  device runtime's functions are found: ``/proc`` on Linux, the module list elsewhere), and what the driver allows
  (Windows refuses page-locking past about half of RAM; Apple's unified memory has nothing to lock).
* **Page blocks** (:func:`page_block`): host memory that starts on a page and holds whole pages, in a mapping of its
  own where the OS has anonymous mappings (freed to the system when dropped), else a buffer narrowed to a page.
* **Files** (:func:`map_file`, :func:`release_file_pages`, :func:`read_at`): read-only mappings, giving their pages
  back where the OS can, positional reads where it has them.
* **Host registration** is page-granular, so page blocks hold whole pages; its books and its one API
  (``core.devices.pinned``) work from the page size and the driver's limit given here.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from types import SimpleNamespace
from typing import Any

import psutil
import torch

log = logging.getLogger("device_control")

#: The Linux process file listing every mapping, libraries included.
_MAPS = "/proc/self/maps"


@dataclass(frozen=True, eq=False)
class Platform:
    """What the operating system offers the pack, as far as the pack touches it.

    Attributes:
        name: ``windows``, ``linux``, ``macos`` (or another OS's name); a simulated profile's own name.
        mmap: the OS's ``mmap`` module (a simulated profile's stand-in has that OS's signature and constants).
        page: bytes of a page: what host registration locks whole, and what a page block is aligned to.
        libraries: the paths of the shared libraries loaded in this process.
        open_library: a loaded library's functions, as attributes of what it returns.
        registration_limit: the share of RAM past which the driver refuses to page-lock more (Windows: about
            half); ``None`` where no such limit is known.
        unified_memory: the devices share the host's memory (Apple silicon): nothing to page-lock, no streams.
        nvml: the file name of NVIDIA's management library here (how many GPUs the driver has); empty: none.
        ram: the bytes of RAM (``None``: as the OS reports them).
    """

    name: str
    mmap: Any
    page: int
    libraries: Callable[[], Sequence[str]]
    open_library: Callable[[str], Any]
    registration_limit: float | None = None
    unified_memory: bool = False
    nvml: str = ""
    ram: int | None = None

    def ram_bytes(self) -> int:
        """The bytes of RAM this platform has."""
        return self.ram if self.ram is not None else int(psutil.virtual_memory().total)

    def registration_cap(self) -> int | None:
        """The most bytes the driver page-locks in this process, or ``None`` where it sets no limit."""
        if self.registration_limit is None:
            return None
        return int(self.ram_bytes() * self.registration_limit)


def _os_name() -> str:
    if sys.platform.startswith("win"):
        return "windows"
    if sys.platform == "darwin":
        return "macos"
    return sys.platform.rstrip("0123456789") or sys.platform


def loaded_libraries() -> list[str]:
    """The files mapped into this process that are shared libraries: from ``/proc`` where the OS has it, else from
    the process's module list (Windows, the BSDs); empty where neither can be read (macOS without psutil's maps)."""
    if os.path.exists(_MAPS):
        with open(_MAPS, encoding="utf-8", errors="replace") as maps:
            rows = [line.split(maxsplit=5) for line in maps]
        return sorted({row[5].strip() for row in rows if len(row) == 6})
    try:
        return sorted({region.path for region in psutil.Process().memory_maps(grouped=True)})
    except (AttributeError, NotImplementedError, psutil.Error, OSError):
        return []


def open_library(path: str) -> Any:
    """A loaded shared library's handle (the one the process already has: loading it again maps nothing new)."""
    return ctypes.CDLL(path)


@cache
def os_platform() -> Platform:
    """This machine's own platform."""
    name = _os_name()
    return Platform(
        name=name,
        mmap=mmap,
        page=int(mmap.PAGESIZE),
        libraries=loaded_libraries,
        open_library=open_library,
        # Windows' driver refuses page-locking past about half of RAM (ComfyUI caps its own at 40 % there).
        registration_limit=0.5 if name == "windows" else None,
        unified_memory=name == "macos",
        nvml={"windows": "nvml.dll", "macos": ""}.get(name, "libnvidia-ml.so.1"),
    )


_platform: Platform | None = None


def platform() -> Platform:
    """The platform the pack runs on: this machine's, or the simulated one in use (:func:`use_platform`)."""
    return _platform if _platform is not None else os_platform()


def use_platform(chosen: Platform | None) -> None:
    """Run on ``chosen`` from now on (``None``: this machine's own); the settings and the tests do this."""
    global _platform
    _platform = chosen


@contextlib.contextmanager
def platform_in_use(chosen: Platform | None) -> Iterator[Platform]:
    """Run on ``chosen`` inside the ``with`` block (tests)."""
    previous = _platform
    use_platform(chosen)
    try:
        yield platform()
    finally:
        use_platform(previous)


def page_size() -> int:
    """The host's page size in bytes: what host registration locks whole."""
    return platform().page


def whole_pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages."""
    page = page_size()
    return -(-nbytes // page) * page


def page_block(nbytes: int) -> torch.Tensor:
    """``nbytes`` of host memory (rounded up to whole pages) that starts on a page, so it can be page-locked
    without touching a page anything else lies on.

    Where the OS has anonymous mappings (every OS the pack runs on), the block is a private mapping of its own: it
    is given back to the system when dropped (the C allocator keeps large freed blocks for itself), and, as the C
    allocator's own memory, it is not shared memory to the kernel. Elsewhere it is a buffer narrowed to a page.
    """
    size = whole_pages(max(nbytes, 1))
    mapping = _anonymous(platform().mmap, size)
    if mapping is not None:
        block = torch.frombuffer(mapping, dtype=torch.uint8)
        if block.data_ptr() % page_size() == 0:
            return block.narrow(0, 0, size)
    raw = torch.empty(size + page_size(), dtype=torch.uint8)
    return raw.narrow(0, -raw.data_ptr() % page_size(), size)


def _anonymous(module: Any, size: int) -> Any | None:
    """An anonymous private mapping of ``size`` bytes, called as the OS's ``mmap`` wants it; ``None`` where it has
    none or the mapping fails (no address space)."""
    anonymous = getattr(module, "MAP_ANONYMOUS", None) or getattr(module, "MAP_ANON", None)
    try:
        if hasattr(module, "MAP_PRIVATE") and anonymous is not None:  # Unix: flags say private and anonymous
            return module.mmap(-1, size, flags=module.MAP_PRIVATE | anonymous)
        return module.mmap(-1, size)  # Windows: file number -1 is memory of the paging file, the process's own
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        log.debug("[Device Control] no anonymous mapping of %d bytes here (%s); using a narrowed buffer", size, exc)
        return None


def map_file(fd: int) -> Any | None:
    """A read-only mapping of the whole file ``fd`` (read-only: a private writable one is charged against the
    commit limit in full), or ``None`` where it cannot be mapped; only where its pages can be given back
    (:func:`release_file_pages`), since a converting copy from a mapping that keeps them would hold the whole file
    in the process by the end of a load."""
    module = platform().mmap
    if not _can_release(module):
        return None
    try:
        return module.mmap(fd, 0, access=module.ACCESS_READ)
    except (OSError, ValueError):  # no address space: the reader's staging path serves every read
        return None


def _can_release(module: Any) -> bool:
    return hasattr(module, "MADV_DONTNEED") and hasattr(getattr(module, "mmap", None), "madvise")


def release_file_pages(mapping: Any, start: int, nbytes: int) -> None:
    """Give back the pages of ``mapping`` that hold bytes ``start`` to ``start + nbytes`` (the kernel's page cache
    keeps them; the process no longer counts them)."""
    page = page_size()
    first = start // page * page
    mapping.madvise(platform().mmap.MADV_DONTNEED, first, start + nbytes - first)


def read_at(fd: int, view: memoryview, position: int) -> int:
    """Read into ``view`` from byte ``position`` of ``fd``: positional where the OS has it, else seek and read (on
    Windows each file has one reader, so seeking is safe); the bytes read (0 at the end of the file)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], position)
    os.lseek(fd, position, os.SEEK_SET)
    data = os.read(fd, len(view))
    view[: len(data)] = data
    return len(data)


def runtime_function(libraries: Sequence[str], name: str, *, text: bool = False) -> Callable[..., Any] | None:
    """Function ``name`` of the first loaded library whose file name contains one of ``libraries`` (``cudart``:
    ``libcudart.so.12`` on Linux, ``cudart64_12.dll`` on Windows), from the instance this process loaded (the one
    torch uses); ``None`` where none is loaded or it lacks the function. ``text``: it returns a C string, given
    back as ``str``."""
    found = platform()
    for path in found.libraries():
        base = os.path.basename(path.replace("\\", "/")).lower()
        if not any(part in base for part in libraries):
            continue
        try:
            function = getattr(found.open_library(path), name)
        except (OSError, AttributeError):
            continue
        if not text:
            return function
        if isinstance(function, ctypes._CFuncPtr):
            function.restype = ctypes.c_char_p
        return lambda *args: _as_text(function(*args))
    return None


def _as_text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def nvidia_driver_devices() -> int | None:
    """How many NVIDIA GPUs the driver has, whatever ``CUDA_VISIBLE_DEVICES`` hides from this process (its
    management library counts them all); ``None`` where that library is not here. (torch's own count loads the
    library by its Linux name only, so it cannot tell on Windows.)"""
    found = platform()
    if not found.nvml:
        return None
    try:
        nvml = found.open_library(found.nvml)
        if nvml.nvmlInit_v2() != 0:
            return None
        count = ctypes.c_uint(0)
        status = nvml.nvmlDeviceGetCount_v2(ctypes.byref(count))
        nvml.nvmlShutdown()
    except (OSError, AttributeError):
        return None
    return int(count.value) if status == 0 else None


#: ``cudaHostRegisterPortable``: the registered range is usable from every device.
_REGISTER_PORTABLE = 1
#: The runtime libraries torch loads, by a part of their file names (Linux ``libcudart.so.12``, Windows
#: ``cudart64_12.dll``; ROCm ``libamdhip64.so``, ``amdhip64_6.dll``).
_RUNTIMES = ("cudart", "amdhip64")


class CudaRuntime:
    """Host registration through the CUDA runtime torch loaded (or HIP's, in a ROCm build of torch).

    A failed ``cudaHostRegister`` leaves its error as the runtime's last one, which the next kernel launch's check
    reports as its own (seen on an H100: "part or all of the requested memory range is already mapped" raised by a
    forward after a failed registration), so it must be read back with :meth:`take_error`. torch's binding has the
    registration calls but not ``cudaGetLastError`` (torch 2.14): that one comes from the runtime library this
    process loaded, found by the platform (``/proc`` on Linux, the module list on Windows).
    """

    def __init__(self) -> None:
        self._found: dict[tuple[Platform, str], Any] = {}

    def register(self, pointer: int, size: int) -> bool:
        """Page-lock ``size`` bytes at ``pointer``; ``False`` (its error pending) where the runtime refused."""
        return _code(torch.cuda.cudart().cudaHostRegister(pointer, size, _REGISTER_PORTABLE)) == 0

    def unregister(self, pointer: int) -> bool:
        """Unlock the range registered at ``pointer``; ``False`` (its error pending) where the runtime refused."""
        return _code(torch.cuda.cudart().cudaHostUnregister(pointer)) == 0

    def reads_errors(self) -> bool:
        """Whether the last error can be read back here (without it, nothing may be registered)."""
        return self._last_error_call() is not None

    def take_error(self) -> str | None:
        """Read and clear the runtime's last error (``cudaGetLastError``): its text, or ``None`` when there was
        none or it cannot be read."""
        last = self._last_error_call()
        code = 0 if last is None else _code(last())
        if code == 0:
            return None
        describe = self._runtime(self._name("GetErrorString"), text=True)
        return f"CUDA error {code}" if describe is None else describe(code)

    def _name(self, call: str) -> str:
        return ("hip" if torch.version.hip else "cuda") + call

    def _last_error_call(self) -> Callable[[], Any] | None:
        name = self._name("GetLastError")
        return getattr(torch.cuda.cudart(), name, None) or self._runtime(name)

    def _runtime(self, name: str, *, text: bool = False) -> Callable[..., Any] | None:
        """Function ``name`` of the runtime library, looked up once per platform (the lookup reads the process's
        library list)."""
        key = (platform(), name)
        if key not in self._found:
            self._found[key] = runtime_function(_RUNTIMES, name, text=text)
        return self._found[key]


def _code(result: Any) -> int:
    """A runtime call's result as a number (torch's binding returns its ``cudaError`` enum)."""
    return int(getattr(result, "value", result))


# -- the OS surfaces the simulated platforms (``core.devices.sim.platforms``) give the pack, built over this
# machine's own ``mmap``: here, as every call to the OS is ------------------------------------------------------

KiB = 1024


def _aligned_anonymous(length: int, granularity: int) -> memoryview:
    """``length`` bytes of a private anonymous mapping starting at a multiple of ``granularity`` (over-mapped and
    narrowed: this machine's mappings start on its own, smaller pages)."""
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    whole = mmap.mmap(-1, length + granularity, flags=private)
    start = -_address(whole) % granularity
    return memoryview(whole)[start : start + length]


def _address(mapping: Any) -> int:
    return torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()


def windows_mmap(granularity: int = 64 * KiB) -> SimpleNamespace:
    """Windows' ``mmap`` module as far as the pack uses it: its signature ``mmap(fileno, length, tagname=None,
    access=ACCESS_DEFAULT, offset=0)``, its constants (no ``MAP_*``, ``PROT_*`` or ``MADV_*``, and mappings
    without ``madvise``: a mapped file's pages cannot be given back), 4 KiB pages and mappings at 64 KiB
    boundaries."""

    def mapped(
        fileno: int, length: int, tagname: str | None = None, access: int = mmap.ACCESS_DEFAULT, offset: int = 0
    ) -> Any:
        if offset % granularity:
            raise OSError(87, "The parameter is incorrect (offset is not a multiple of the allocation granularity)")
        if fileno == -1:  # memory of the paging file, the process's own
            return _aligned_anonymous(length, granularity)
        return mmap.mmap(fileno, length, access=access, offset=offset)

    return SimpleNamespace(
        mmap=mapped,
        PAGESIZE=4 * KiB,
        ALLOCATIONGRANULARITY=granularity,
        ACCESS_DEFAULT=mmap.ACCESS_DEFAULT,
        ACCESS_READ=mmap.ACCESS_READ,
        ACCESS_WRITE=mmap.ACCESS_WRITE,
        ACCESS_COPY=mmap.ACCESS_COPY,
        error=OSError,
    )


def unix_mmap(page: int) -> SimpleNamespace:
    """A Unix ``mmap`` module whose pages are ``page`` bytes: this machine's signature and constants (``MAP_ANON``
    beside ``MAP_ANONYMOUS``, as macOS's and Linux's have them), its mappings starting on such pages."""

    def mapped(fileno: int, length: int, flags: int = mmap.MAP_SHARED, **keywords: Any) -> Any:
        if fileno == -1 and flags & mmap.MAP_ANONYMOUS:
            return _aligned_anonymous(length, page)
        return mmap.mmap(fileno, length, flags=flags, **keywords)

    names = [name for name in dir(mmap) if name.isupper() and name not in ("PAGESIZE", "ALLOCATIONGRANULARITY")]
    constants = {name: getattr(mmap, name) for name in names}
    return SimpleNamespace(mmap=mapped, PAGESIZE=page, ALLOCATIONGRANULARITY=page, error=OSError, **constants)
