"""Benchmarks, side by side with ComfyUI in one run; writes Markdown tables and the raw runs to ``docs/bench/``.

    python3 tools/bench/run_all.py                       # every section, 5 runs each
    python3 tools/bench/run_all.py --only ops --runs 7   # one section (loader, split_loaders, detection, ops,
                                                 # patching, policy, panel, soak, streaming, slices, host), more runs
    python3 tools/bench/run_all.py --out /tmp/bench      # write elsewhere

Every measurement runs in a fresh process (``tools/bench/workers.py``, ``tools/bench/panel.py``,
``tools/bench/soak.py``), ``--runs`` times, ComfyUI's and ours alternating, so that drift hits both. A cell is
the median of the runs with their minimum and maximum: ``4.0 s (3.8-4.4)``. A figure that is itself measured
over thousands of samples in one long run (the 10,000-request load, the 200-cycle soak) comes from one run,
and says so. Each section writes ``<section>.md`` (its table, the machine, its load) and ``raw/<section>.json``
(every run's output) under the output folder; the figures README and docs/ quote are those tables
(index: docs/bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from any folder

from tools.bench.format import DETECTED_FILES, SD15
from tools.bench.loads import SPLIT_FILES
from tools.bench.tables import TABLES
from tools.runtime.provision import PRIMARY_VERSION, REPO, fixtures_dir, provision, venv_python

log = logging.getLogger("device_control.tools")
#: Every sparse file the sections read: label -> (name in the layouts, file name).
SPARSE = DETECTED_FILES | SPLIT_FILES


@dataclass
class Spread:
    """One figure over several runs."""

    values: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def show(self, fmt: Callable[[float], str]) -> str:
        """``4.0 s (3.8-4.4)``: the median, then the smallest and largest run (in the median's unit)."""
        low, high = _bare(fmt(min(self.values))), _bare(fmt(max(self.values)))
        return f"{fmt(self.median)} ({low}-{high})"


def _bare(text: str) -> str:
    """``3.8 s`` -> ``3.8``; ``0.98x`` -> ``0.98``: a range after a median needs its unit once."""
    number, _, _unit = text.rpartition(" ")
    return number if number else text.rstrip("x")


def aggregate(runs: list[Any]) -> Any:
    """Runs of one worker (JSON of the same shape) as one record whose numbers are :class:`Spread` s."""
    first = runs[0]
    if isinstance(first, dict):
        return {key: aggregate([run[key] for run in runs]) for key in first}
    if isinstance(first, bool) or not isinstance(first, (int, float)):
        return first
    return Spread([float(run) for run in runs])


def worker(*args: str, module: str = "tools.bench.workers") -> dict:
    """One measurement in a fresh process of the runtime's Python; its last output line, as JSON."""
    done = subprocess.run(
        [str(venv_python()), "-m", module, *args], cwd=REPO, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"benchmark worker {module} {args} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def files() -> dict[str, Path]:
    """The synthetic SD1.5 and the sparse layouts the benchmarks read (made once), by label."""
    subprocess.run([str(venv_python()), "-m", "tools.fixtures.make"], cwd=REPO, check=True, capture_output=True)
    code = (
        "import sys, tools.fixtures.layouts as l; from pathlib import Path\n"
        "for name, out in zip(sys.argv[1::2], sys.argv[2::2]):\n"
        "    p = Path(out)\n"
        "    p.exists() or l.write_sparse_safetensors(l.layouts()[name], p)\n"
    )
    bench = fixtures_dir() / "bench"
    bench.mkdir(parents=True, exist_ok=True)
    args = [item for name, out in SPARSE.values() for item in (name, str(bench / out))]
    subprocess.run([str(venv_python()), "-c", code, *args], cwd=REPO, check=True)
    found = {SD15: fixtures_dir() / "checkpoints" / "device_control_sd15_synthetic.safetensors"}
    return found | {label: bench / out for label, (_name, out) in SPARSE.items()}


def machine() -> dict[str, Any]:
    """What the figures were taken on, and how busy it was (load average, CPU use by everything over 1 s).

    Standard library only (Linux's ``/proc``): this runs before the runtime's packages exist.
    """
    return {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3, 1),
        "python": platform.python_version(),
        "comfyui": PRIMARY_VERSION,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": [round(value, 2) for value in os.getloadavg()],
        "cpu_busy_percent": _cpu_busy(1.0),
    }


def _cpu_busy(seconds: float) -> float:
    """Share of all CPUs' time spent busy over ``seconds``, from ``/proc/stat``."""

    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields), idle

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return round(100 * (1 - (idle1 - idle0) / max(1, total1 - total0)), 1)


def run_section(name: str, runs: int, paths: dict[str, Path], out: Path) -> str:
    """Measure one section ``runs`` times, write its table and raw runs under ``out``; return the table."""
    before = machine()
    raw, table = TABLES[name](runs, paths, worker, aggregate)
    after = machine()
    header = (
        f"Taken {before['date']} on {before['machine']}, {before['cpus']} CPUs, {before['ram_gib']} GiB RAM, no GPU, "
        f"Python {before['python']}, ComfyUI {before['comfyui']}; load average before / after "
        f"{before['load_average'][0]} / {after['load_average'][0]}, CPU busy before {before['cpu_busy_percent']} %. "
        f"`python3 tools/bench/run_all.py --only {name} --runs {runs}`; raw runs in `raw/{name}.json`."
    )
    (out / "raw").mkdir(parents=True, exist_ok=True)
    (out / "raw" / f"{name}.json").write_text(json.dumps({"before": before, "after": after, "runs": raw}, indent=1))
    (out / f"{name}.md").write_text(f"{header}\n\n{table}\n")
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(TABLES), action="append", help="run only these sections")
    parser.add_argument("--runs", type=int, default=5, help="runs per measurement (at least 5 for README figures)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench", help="where tables and raw runs go")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    provision()
    paths = files()
    for name in args.only or list(TABLES):
        log.info("\n### %s\n\n%s", name, run_section(name, args.runs, paths, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
