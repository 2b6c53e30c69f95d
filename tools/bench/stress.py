"""Load and soak drivers for a running ComfyUI with the pack: shared by the tests (CI-sized) and the benchmarks
(full size), so the figures README states come from the same code the tests run.

* :func:`soak`: cycles of load -> Move To GPU (budgeted) -> sample -> Offload To CPU -> decode, one prompt each,
  the loader alternating between two names of the checkpoint so every cycle loads from disk and the previous
  model is released; returns RSS and the simulated GPU's books per cycle.
* :func:`snapshot_load`: many ``GET /device_control/snapshot`` requests from concurrent clients, with many
  websocket clients subscribed to the push, while workflows run back to back.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from tools.fixtures.make import SD15_CHECKPOINT
from tools.runtime.server import ComfyServer
from tools.templates.workflow_api import load_workflow, ui_to_api

REPO = Path(__file__).resolve().parents[2]
WORKFLOW = REPO / "workflows" / "01 Start here - SD1.5 moved to the GPU, then offloaded.json"
SECOND_NAME = SD15_CHECKPOINT.replace(".safetensors", "_b.safetensors")
#: The example workflow's node ids.
LOADER, MOVE, SAMPLER, OFFLOAD = "1", "3", "8", "9"
AFTER_LOAD, AFTER_OFFLOAD, AFTER_DECODE = "2", "10", "12"
T = TypeVar("T")


def example_prompt(server: ComfyServer, steps: int = 1) -> dict[str, Any]:
    """The example workflow (load, Move To GPU, sample, Offload To CPU, decode) as an API prompt."""
    prompt = ui_to_api(load_workflow(WORKFLOW), server.get("/object_info"))
    prompt[SAMPLER]["inputs"]["steps"] = steps
    return prompt


def fresh(prompt: dict[str, Any]) -> dict[str, Any]:
    """The prompt with a new seed, so ComfyUI samples again instead of answering from its cache."""
    prompt[SAMPLER]["inputs"]["seed"] = uuid.uuid4().int % 2**32
    return prompt


def _report(entry: dict[str, Any], node: str) -> dict[str, Any]:
    return json.loads(entry["outputs"][node]["device_control_report"][0])


def _gpu_allocated(report: dict[str, Any]) -> int:
    return next(d for d in report["devices"] if d["id"] == "gpu:0")["torch_allocated"]


#: Cycles before the baseline. ComfyUI's caches settle in two; with the ring, whose slabs (tens of MB each) are made
#: and freed as the two checkpoint names are loaded in turn, the allocator's heap settles in four (a fresh-clone
#: run's RSS, MB: 5127, 5472, 5527, 5596, then 5598 for six cycles: docs/bench/raw/soak_slab_copies_2026-11-26.txt).
WARMUP_CYCLES = 4


@dataclass
class SoakResult:
    """RSS and simulated-GPU books, per cycle, after the model was offloaded and the image decoded."""

    rss: list[int] = field(default_factory=list)
    gpu_after_offload: list[int] = field(default_factory=list)
    gpu_before: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    warmup: int = WARMUP_CYCLES

    @property
    def baseline_rss(self) -> int:
        """RSS at the end of the last warm-up cycle (ComfyUI's caches and the allocator's heap have settled by then)."""
        return self.rss[self.warmup - 1]

    @property
    def drift(self) -> int:
        """RSS after the last cycle minus the baseline, in bytes."""
        return self.rss[-1] - self.baseline_rss

    def to_dict(self) -> dict[str, Any]:
        return {
            "cycles": len(self.rss),
            "warmup": self.warmup,
            "baseline_rss": self.baseline_rss,
            "final_rss": self.rss[-1],
            "max_rss": max(self.rss[self.warmup - 1 :]),
            "drift": self.drift,
            "gpu_after_offload": sorted(set(self.gpu_after_offload)),
            "gpu_before": sorted(set(self.gpu_before)),
            "median_cycle_s": statistics.median(self.seconds),
            "rss_mb": [round(rss / 2**20) for rss in self.rss],
        }


def soak(
    server: ComfyServer, cycles: int, budget: str = "2GB", on_cycle: Callable[[int, SoakResult], None] | None = None
) -> SoakResult:
    """Run ``cycles`` load -> move (``budget``) -> sample -> offload -> decode prompts; see :class:`SoakResult`."""
    prompt = example_prompt(server)
    prompt[MOVE]["inputs"]["vram_budget"] = budget
    result = SoakResult(warmup=min(WARMUP_CYCLES, cycles))
    for cycle in range(cycles):
        prompt[LOADER]["inputs"]["ckpt_name"] = SECOND_NAME if cycle % 2 else SD15_CHECKPOINT
        started = time.perf_counter()
        entry = server.run(fresh(prompt))
        result.seconds.append(time.perf_counter() - started)
        result.gpu_before.append(_gpu_allocated(_report(entry, AFTER_LOAD)))
        result.gpu_after_offload.append(_gpu_allocated(_report(entry, AFTER_OFFLOAD)))
        result.rss.append(_report(entry, AFTER_DECODE)["host"]["process_rss"])
        if on_cycle is not None:
            on_cycle(cycle, result)
    return result


class Workflows:
    """Runs the example workflow back to back on a thread until the block ends, loading the checkpoint under
    its two names in turn; counts runs and failures."""

    def __init__(self, server: ComfyServer) -> None:
        self.server = server
        self.prompt = example_prompt(server)
        self.runs = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            # The other name each run: the previous models are released while the next ones load.
            self.prompt[LOADER]["inputs"]["ckpt_name"] = SECOND_NAME if self.runs % 2 else SD15_CHECKPOINT
            try:
                self.server.run(fresh(self.prompt))
                self.runs += 1
            except Exception as exc:  # recorded; the caller reports it
                self.failures.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> Workflows:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=600)


def run_coroutine(coroutine: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on a thread of its own: the calling thread may already run an event loop (Playwright's
    sync API leaves one in the test process)."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = asyncio.run(coroutine)
        except BaseException as exc:  # handed to the caller
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="device_control.stress")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def percentile(values: list[float], share: float) -> float:
    """The ``share`` percentile of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(share * len(ordered)) - 1))]


async def _listener(url: str, client: str, stop: asyncio.Event, counts: dict[str, int], errors: list[str]) -> None:
    try:
        async with aiohttp.ClientSession() as session, session.ws_connect(f"{url}/ws?clientId={client}") as ws:
            counts[client] = 0
            await _post(session, url, "/device_control/subscribe", {"interval": 1, "client": client})
            while not stop.is_set():
                try:
                    message = await ws.receive(timeout=0.5)
                except asyncio.TimeoutError:
                    continue
                if message.type == aiohttp.WSMsgType.TEXT:
                    if '"device_control.vram"' in message.data[:60]:
                        counts[client] += 1
                elif message.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                    errors.append(f"websocket {client[:8]} closed: {message.type.name}")
                    return
            await _post(session, url, "/device_control/subscribe", {"interval": 0, "client": client})
    except aiohttp.ClientError as exc:
        errors.append(f"websocket {client[:8]}: {type(exc).__name__}: {exc}")


async def _post(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> None:
    async with session.post(url + path, json=body) as response:
        response.raise_for_status()


async def _requester(url: str, count: int, times: list[float], errors: list[str]) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(count):
            started = time.perf_counter()
            async with session.get(url + "/device_control/snapshot") as response:
                body = await response.read()
                if response.status != 200 or b'"devices"' not in body:
                    errors.append(f"snapshot answered {response.status}: {body[:200]!r}")
            times.append((time.perf_counter() - started) * 1000)


async def _load(url: str, requests: int, clients: int, requesters: int) -> dict[str, Any]:
    stop = asyncio.Event()
    counts: dict[str, int] = {}
    errors: list[str] = []
    times: list[float] = []
    listeners = [asyncio.create_task(_listener(url, uuid.uuid4().hex, stop, counts, errors)) for _ in range(clients)]
    while len(counts) < clients and not errors:
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.5)  # every listener subscribed: a push or two reaches all of them
    started = time.perf_counter()
    await asyncio.gather(*(_requester(url, requests // requesters, times, errors) for _ in range(requesters)))
    elapsed = time.perf_counter() - started
    await asyncio.sleep(1.5)
    stop.set()
    await asyncio.gather(*listeners)
    return {
        "requests": len(times),
        "clients": clients,
        "seconds": elapsed,
        "median_ms": statistics.median(times),
        "p99_ms": percentile(times, 0.99),
        "max_ms": max(times),
        "errors": errors,
        "pushes_min": min(counts.values(), default=0),
        "pushes_total": sum(counts.values()),
    }


def snapshot_load(server: ComfyServer, requests: int = 10_000, clients: int = 100, requesters: int = 4) -> dict:
    """``requests`` snapshot GETs from ``requesters`` concurrent clients while ``clients`` websocket clients
    listen to the push and the example workflow runs back to back; latencies, pushes, errors and runs."""
    with Workflows(server) as workflows:
        while workflows.runs == 0 and not workflows.failures:  # the models are loaded, sampling is under way
            time.sleep(0.2)
        result = run_coroutine(_load(server.url, requests, clients, requesters))
    return {**result, "workflow_runs": workflows.runs, "workflow_failures": workflows.failures}
