"""The floor of a load on this machine: the processor time that reading, writing and converting its bytes take.

    .runtime/venv/bin/python -m tools.bench.floor DTYPE RESIDENT COLD FILE [FILE ...]

``DTYPE`` is the torch dtype the load keeps most of its bytes in (``float8_e4m3fn``...).

Any loader has to read every byte of its files, write every byte it keeps into memory nobody has touched yet,
and convert what the requested dtype changes. Each is measured here on its own, the fastest way we know: files
read in positional reads of 128 KiB and of 16 MiB into one reused buffer (``COLD`` 1: the files dropped from the
page cache first, as the benchmark's loads find a file too large to stay cached), ``RESIDENT`` bytes of fresh
memory written once on one thread and once on torch's, and the conversion from the files' dtype to ``DTYPE`` in
our float32 steps between buffers already in memory, timed on 256 Mi elements and scaled to the elements
converted. On a machine where all three are processor work (files in the page cache or sparse, as the
benchmark's are) no load can take less wall time than their processor time divided by the cores (each part's
fastest try): that is ``floor``; ``wall`` is their wall times added. Printed as one JSON line, like
``tools.bench.workers``.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

from core.detection.headers import SAFETENSORS_DTYPES, read_header
from core.files.converting import Float32Steps
from tools.bench.loads import drop_from_page_cache

#: Elements the conversion is timed on (scaled to the load's count).
SAMPLE = 1 << 28
#: Bytes per positional read, each size tried: small reads stay in the processor's cache (fastest from the page
#: cache), large ones let the kernel read ahead further (fastest from a file that is not cached).
READ_CHUNKS = (128 * 1024, 16 * 1024**2)


def processor_seconds() -> float:
    """User and system time of this process so far, every thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def read_files(paths: list[Path], cold: bool) -> dict[str, float]:
    """Read every byte of ``paths`` once per size of ``READ_CHUNKS``, into one reused buffer; the fastest (in
    processor time) counts. When ``cold`` the files are dropped from the page cache first, outside the timing."""
    return min((_read_once(paths, cold, chunk) for chunk in READ_CHUNKS), key=lambda part: part["cpu"])


def _read_once(paths: list[Path], cold: bool, chunk: int) -> dict[str, float]:
    if cold:
        for path in paths:
            drop_from_page_cache(path)
    view = memoryview(bytearray(chunk))
    started, cpu = time.perf_counter(), processor_seconds()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            position = 0
            while count := os.preadv(fd, [view], position):
                position += count
        finally:
            os.close(fd)
    return {"seconds": time.perf_counter() - started, "cpu": processor_seconds() - cpu, "chunk": chunk}


def write_fresh(nbytes: int) -> dict[str, float]:
    """Write ``nbytes`` of memory nobody has touched yet, once on one thread and once on torch's threads; the
    fastest (in processor time) counts."""
    threads = torch.get_num_threads()
    tries = []
    for count in sorted({1, threads}):
        torch.set_num_threads(count)
        started, cpu = time.perf_counter(), processor_seconds()
        torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        tries.append({"seconds": time.perf_counter() - started, "cpu": processor_seconds() - cpu, "threads": count})
    torch.set_num_threads(threads)
    return min(tries, key=lambda part: part["cpu"])


def convert(stored: torch.dtype, target: torch.dtype, elements: int) -> dict[str, float]:
    """Convert ``elements`` from ``stored`` to ``target`` as our loaders do, timed on ``SAMPLE`` and scaled."""
    steps = Float32Steps()
    sample = min(SAMPLE, elements)
    source = torch.ones(sample, dtype=stored)
    dest = torch.empty(sample, dtype=target)
    dest.view(torch.uint8).fill_(0)  # written once before: the conversion alone is timed
    steps.copy(dest, source)  # threads started, code paths warm
    started, cpu = time.perf_counter(), processor_seconds()
    steps.copy(dest, source)
    scale = elements / sample
    steps.release()
    return {"seconds": (time.perf_counter() - started) * scale, "cpu": (processor_seconds() - cpu) * scale}


def floor(dtype: str, resident: int, cold: bool, paths: list[Path]) -> dict:
    """Each part's wall and processor time, and the floor (processor time over the cores)."""
    target = getattr(torch, dtype)
    infos = [info for path in paths for info in read_header(path).tensors.values()]
    stored = max(infos, key=lambda info: info.numel).dtype  # the files' dtype (of their largest tensor)
    stored_dtype = SAFETENSORS_DTYPES[stored][1]
    converted = 0 if target == stored_dtype else sum(info.numel for info in infos if info.dtype == stored)
    parts = {"read": read_files(paths, cold), "write": write_fresh(resident)}
    parts["convert"] = convert(stored_dtype, target, converted) if converted else {"seconds": 0.0, "cpu": 0.0}
    cores = len(os.sched_getaffinity(0))
    return parts | {
        "cores": cores,
        "converted": converted,
        "floor": sum(part["cpu"] for part in parts.values()) / cores,
        "wall": sum(part["seconds"] for part in parts.values()),
    }


def main() -> None:
    dtype, resident, cold = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    sys.stdout.write(json.dumps(floor(dtype, resident, cold, [Path(p) for p in sys.argv[4:]])) + "\n")


if __name__ == "__main__":
    main()
