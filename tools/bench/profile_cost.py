"""What recording the memory profile costs a run: the example workflow on two ComfyUI servers, one recording
(the default) and one started with ``DEVICE_CONTROL_PROFILE=off``, run in turn; prints a Markdown table.

    .runtime/venv/bin/python -m tools.bench.profile_cost [--runs 8] [--steps 4] [--raw FILE]

Both servers run side by side (a simulated 8 GiB GPU each) and take the prompt in turn, the order swapped every
round, so that drift hits both; only one computes at a time. Half the runs start the recording server first, half
the other. Each run samples again (a new seed); the loader and
the text encoding come from ComfyUI's cache in both. A run's time is ComfyUI's own, from its ``execution_start``
to its ``execution_success`` message (milliseconds, in the prompt's history), so the client's polling is not in
it. The table gives the median of the runs with their range, the difference of the medians, and what the
recording itself took on the executing thread in each recorded run (the profile's ``recording``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from any folder

from tools.bench.stress import example_prompt, fresh
from tools.runtime.server import ComfyServer


def run_time(server: ComfyServer, prompt: dict) -> float:
    """Seconds ComfyUI took to execute ``prompt`` (from its own messages)."""
    entry = server.run(fresh(prompt))
    stamps = {kind: data["timestamp"] for kind, data in entry["status"]["messages"]}
    return (stamps["execution_success"] - stamps["execution_start"]) / 1000


def measure(runs: int, steps: int) -> dict[str, list[float]]:
    """``runs`` run times with the profile recorded (``on``) and not (``off``), and the recording's own time in
    each recorded run (``recording``): half the runs with the recording server started first, half with the
    other (the server started second ran about 4 % faster in a test with both recording)."""
    times: dict[str, list[float]] = {"on": [], "off": [], "recording": []}
    for first in ("on", "off"):
        order = (first, "off" if first == "on" else "on")
        with tempfile.TemporaryDirectory() as base:
            servers = {side: _server(Path(base) / side, side) for side in order}
            try:
                _rounds(servers, steps, runs // 2, times)
            finally:
                for server in servers.values():
                    server.stop()
    return times


def _server(base: Path, side: str) -> ComfyServer:
    env = {"DEVICE_CONTROL_SIMULATE_GPU": "8GiB", "DEVICE_CONTROL_PROFILE": side}
    return ComfyServer(base, env=env).start()


def _rounds(servers: dict[str, ComfyServer], steps: int, rounds: int, times: dict[str, list[float]]) -> None:
    prompt = example_prompt(servers["on"], steps)
    for server in servers.values():  # loads the models and fills the cache: not timed
        run_time(server, prompt)
    for index in range(rounds):
        for side in ("on", "off") if index % 2 == 0 else ("off", "on"):
            times[side].append(run_time(servers[side], prompt))
        recorded = servers["on"].get("/device_control/profile")
        assert recorded["status"] == "success", recorded  # it did record
        times["recording"].append(recorded["recording"])


def table(times: dict[str, list[float]], steps: int) -> str:
    """The Markdown table of ``times``."""
    cell = {side: f"{statistics.median(v):.3f} s ({min(v):.3f}-{max(v):.3f})" for side, v in times.items()}
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    return "\n".join(
        [
            "| workflow | runs | profile recorded | profile off | difference of the medians | recording's own time |",
            "| --- | --- | --- | --- | --- | --- |",
            f"| the starter (01), {steps} steps | {len(times['on'])} | {cell['on']} | {cell['off']} |"
            f" {(on - off) / off * 100:+.1f} % | {cell['recording']} |",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--raw", type=Path, default=None, help="where to write the run times (JSON)")
    args = parser.parse_args(argv)
    times = measure(args.runs, args.steps)
    if args.raw is not None:
        args.raw.write_text(json.dumps({"steps": args.steps, "seconds": times}, indent=2) + "\n")
    sys.stdout.write(table(times, args.steps) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
