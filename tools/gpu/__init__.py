"""The short run on a lent GPU machine with no network (``docs/bench/gpu.md``): developers run it when a GPU is lent.

* :mod:`~tools.gpu.carry`: packs what the bare machine needs beside the repository (``gpu_carry/``).
* ``session.sh``: the one prepared call, the GPU benchmark then the GPU test tier; ``stand_ins/``: test-only
  modules the bare machine lacks.
* :mod:`~tools.gpu.bench` (:mod:`~tools.gpu.card`, :mod:`~tools.gpu.runs`, :mod:`~tools.gpu.fixtures`,
  :mod:`~tools.gpu.report`): streaming on a small card, ours beside ComfyUI's own offloading.
"""
