"""The long soak: load -> Move To GPU (2 GB budget) -> sample -> Offload To CPU -> decode, 200 cycles, on a real
ComfyUI with a simulated 8 GiB GPU; prints one JSON line (``tools/bench/run_all.py --only soak`` starts it).

The same driver as the soak test (``tools/bench/stress.py``), which CI runs for 10 cycles.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tools.bench.stress import soak
from tools.runtime.server import ComfyServer

CYCLES = 200


def main() -> int:
    cycles = int(sys.argv[1]) if len(sys.argv) > 1 else CYCLES
    with tempfile.TemporaryDirectory(prefix="dc-bench-soak-") as base:
        # --cache-classic: what 0.3.x does by default; ComfyUI 0.28 would otherwise keep earlier prompts' models
        # until RAM runs short, and RSS would grow by design (the soak measures what the pack keeps).
        env = {"DEVICE_CONTROL_SIMULATE_GPU": "8GiB"}
        server = ComfyServer(Path(base), env=env, extra_args=("--cache-classic",)).start()
        try:
            result = soak(server, cycles)
            sys.stdout.write(json.dumps({**result.to_dict(), "seconds": result.seconds}) + "\n")  # rss_mb: the series
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
