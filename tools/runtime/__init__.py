"""The real ComfyUIs the tests and demo run, and their servers: who runs it is ``tools/run_tests.py``, the demo and
the test suites, never a user's ComfyUI.

* :mod:`~tools.runtime.provision`: the virtual environment (``requirements.txt``, ``constraints.txt`` here), each
  ComfyUI version's tree and packages, the frontends, Chromium, and where the fixtures live.
* :mod:`~tools.runtime.server` and :mod:`~tools.runtime.forkserver`: a ComfyUI server with the pack, over HTTP.
* :mod:`~tools.runtime.inprocess`: ComfyUI imported into this Python (fixture makers, oracle tests).
* :mod:`~tools.runtime.manager`: the pack installed by the real ComfyUI-Manager.
* :mod:`~tools.runtime.surface_check`: a ComfyUI source tree checked for every symbol the pack uses.
* :mod:`~tools.runtime.reap`: one job of ``tools/run_tests.py``, whose CPU figure then counts all it started.
"""
