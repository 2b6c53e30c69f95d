"""Benchmarks, side by side with ComfyUI in one run: each prints a table, and ``docs/bench/`` keeps the figures with
their raw output and the machine named. Developers run them (``python3 tools/bench/run_all.py``, or one module
with the runtime's Python); no test times anything.

* :mod:`~tools.bench.run_all`, :mod:`~tools.bench.tables`, :mod:`~tools.bench.workers`, :mod:`~tools.bench.format`:
  the loads, panel, split and streaming sections and their fresh worker processes.
* :mod:`~tools.bench.host` (:mod:`~tools.bench.host_counters`, :mod:`~tools.bench.host_report`): the host's work per
  streamed layer call.
* :mod:`~tools.bench.stress`: load and soak drivers the tests share at CI size.
* One question each: :mod:`~tools.bench.cpu_step`, :mod:`~tools.bench.floor`, :mod:`~tools.bench.gguf_step`,
  :mod:`~tools.bench.loads`, :mod:`~tools.bench.panel`, :mod:`~tools.bench.profile_cost`,
  :mod:`~tools.bench.server_loader`, :mod:`~tools.bench.soak`, :mod:`~tools.bench.split`,
  :mod:`~tools.bench.streaming`.
"""
