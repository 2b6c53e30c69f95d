"""What the repository runs besides the pack itself, by concern.

* ``tools/demo.py`` and ``tools/run_tests.py``: README's two commands (a real ComfyUI running an example workflow;
  every test tier). Users and CI run these.
* :mod:`tools.runtime`: provisioning the real ComfyUIs, packages and browser the tests and demo use, and starting
  their servers.
* :mod:`tools.fixtures`: the synthetic models the tests and demo load (no real weights are committed or downloaded).
* :mod:`tools.templates`: the example workflows users start from, their thumbnails and released files.
* :mod:`tools.bench`: benchmarks side by side with ComfyUI, writing ``docs/bench/``.
* :mod:`tools.gpu`: the short run on a lent GPU machine (benchmark and GPU test tier).
"""
