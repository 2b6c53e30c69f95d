"""The live panel's cost, measured on a real ComfyUI with a simulated 8 GiB GPU; prints one JSON line.

Runs in the runtime's venv (``tools/bench/run_all.py`` starts it). What it measures, while the example workflow runs
over and over in the background:

* latency of ``GET /device_control/snapshot`` and, side by side, of ComfyUI's own ``GET /system_stats``:
  1,000 requests each, interleaved, over one kept-alive connection, timed by the client (so HTTP and the
  client's own time are included); once with the example's models loaded and nothing running, once while
  workflows run;
* the push thread's CPU time per second of listening, at the default 1 s rate, with a websocket client
  receiving the pushes (the thread measures its own CPU time);
* the workflow's wall time with the panel open (subscribed at 1 s, a websocket client receiving) and closed,
  alternating runs so that drift hits both equally;
* under load: 10,000 snapshot requests from 4 concurrent clients while 100 websocket clients listen to the
  push at 1 s and workflows run (``tools/bench/stress.py``, which the load test runs too).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import aiohttp

from tools.bench.stress import Workflows, example_prompt, fresh, snapshot_load
from tools.runtime.server import ComfyServer

REQUESTS = 1000
LOAD_REQUESTS = 10_000
LOAD_CLIENTS = 100
RUNS = 6  # per side, for the open/closed comparison (each benchmark run; tools/bench/run_all.py repeats the runs)
STEPS = 4


class Listener:
    """A websocket client on ComfyUI's ``/ws`` that counts the panel's pushes, on its own thread."""

    def __init__(self, url: str, client: str) -> None:
        self.url = f"{url.replace('http', 'ws', 1)}/ws?clientId={client}"
        self.pushes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._listen()), daemon=True)

    async def _listen(self) -> None:
        async with aiohttp.ClientSession() as session, session.ws_connect(self.url) as ws:
            while not self._stop.is_set():
                try:
                    message = await ws.receive(timeout=0.2)
                except asyncio.TimeoutError:
                    continue
                if message.type == aiohttp.WSMsgType.TEXT and '"device_control.vram"' in message.data[:60]:
                    self.pushes += 1

    def __enter__(self) -> Listener:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _latencies(server: ComfyServer) -> dict[str, dict[str, float]]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    paths = {"snapshot": "/device_control/snapshot", "system_stats": "/system_stats"}
    times: dict[str, list[float]] = {name: [] for name in paths}
    made: list[float] = []  # the snapshot's own time, from its Server-Timing header
    for _ in range(REQUESTS):
        for name, path in paths.items():
            started = time.perf_counter()
            connection.request("GET", path)
            response = connection.getresponse()
            response.read()
            times[name].append((time.perf_counter() - started) * 1000)
            timing = response.getheader("Server-Timing")
            if timing:
                made.append(float(timing.rsplit("dur=", 1)[1]))
            if response.status != 200:
                raise RuntimeError(f"{path} answered {response.status}")
    connection.close()
    result = {}
    times["snapshot_made"] = made
    for name, values in times.items():
        values.sort()
        result[name] = {
            "median_ms": statistics.median(values),
            "p99_ms": values[int(0.99 * len(values)) - 1],
            "max_ms": values[-1],
        }
    return result


def main() -> int:
    """``python -m tools.bench.panel [costs|load]``: the route, push and workflow costs (default), or only the
    load test (10,000 requests, 100 listeners), which is one long run of its own."""
    what = sys.argv[1] if len(sys.argv) > 1 else "costs"
    with tempfile.TemporaryDirectory(prefix="dc-bench-panel-") as base:
        server = ComfyServer(Path(base), env={"DEVICE_CONTROL_SIMULATE_GPU": "8GiB"}).start()
        try:
            prompt = example_prompt(server, steps=STEPS)
            server.run(prompt)  # warm: the checkpoint is in the OS cache, ComfyUI's caches are filled
            if what == "load":
                sys.stdout.write(
                    json.dumps({"load": snapshot_load(server, requests=LOAD_REQUESTS, clients=LOAD_CLIENTS)}) + "\n"
                )
                return 0
            idle = _latencies(server)  # the example's models loaded, nothing running

            # Workflow time, panel closed vs open (alternating).
            closed, opened = [], []
            for _ in range(RUNS):
                started = time.perf_counter()
                server.run(fresh(prompt))
                closed.append(time.perf_counter() - started)
                client = uuid.uuid4().hex
                with Listener(server.url, client):
                    server.post("/device_control/subscribe", {"interval": 1, "client": client})
                    started = time.perf_counter()
                    server.run(fresh(prompt))
                    opened.append(time.perf_counter() - started)
                    server.post("/device_control/subscribe", {"interval": 0, "client": client})

            # Route latency and push cost while workflows run back to back.
            client = uuid.uuid4().hex
            with Listener(server.url, client) as listener, Workflows(server) as workflows:
                server.post("/device_control/subscribe", {"interval": 1, "client": client})
                before = server.get("/device_control/snapshot")["push"]
                time.sleep(2)  # the first run is under way
                latencies = _latencies(server)
                time.sleep(20)  # about 20 more pushes while workflows run
                after = server.get("/device_control/snapshot")["push"]
                server.post("/device_control/subscribe", {"interval": 0, "client": client})
            cpu = after["cpu_seconds"] - before["cpu_seconds"]
            active = after["active_seconds"] - before["active_seconds"]
            pushes = after["pushes"] - before["pushes"]
            sys.stdout.write(
                json.dumps(
                    {
                        "latency": latencies,
                        "idle_latency": idle,
                        "workflow_runs_during_latency": workflows.runs,
                        "push": {
                            "cpu_seconds": cpu,
                            "active_seconds": active,
                            "cpu_share": cpu / active if active else 0.0,
                            "pushes": pushes,
                            "received": listener.pushes,
                            "ms_per_push": 1000 * cpu / pushes if pushes else 0.0,
                        },
                        "workflow": {
                            "closed_s": statistics.median(closed),
                            "spread": statistics.stdev(closed) / statistics.median(closed),
                            "open_s": statistics.median(opened),
                            "closed_all": closed,
                            "open_all": opened,
                        },
                    }
                )
                + "\n"
            )
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
