"""The demo: a real ComfyUI with Device Control runs an example workflow and prints what our nodes reported.

From nothing it provisions the runtime (3-5 minutes the first time), makes the synthetic SD1.5 checkpoint (about 30
s the first time), starts ComfyUI with the pack and runs the starter template,
``workflows/01 Start here - SD1.5 moved to the GPU, then offloaded.json``, on it (the workflow names the
released SD1.5 file; the demo swaps in the synthetic one and a small size, as the tests do): load to RAM, Move To
GPU, sample, Offload To CPU, decode, with a VRAM Report after each step. The synthetic checkpoint has random
weights, so the saved image is noise by design; for a real image, put v1-5-pruned-emaonly-fp16.safetensors in
ComfyUI's models/checkpoints and open the template. Without a GPU ComfyUI runs in CPU mode with a simulated 8 GiB
GPU (``--simulate-gpu none`` for none), so the moves show.

    python3 tools/demo.py                     # run, print, keep serving until Ctrl-C
    python3 tools/demo.py --no-serve          # run, print, stop
    python3 tools/demo.py --comfyui 0.33.0    # on another provisioned ComfyUI
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from any folder

from tools.runtime.provision import DEFAULT_VERSION, REPO, TESTED_VERSIONS, provision, runtime_dir, venv_python
from tools.runtime.server import ComfyServer, free_port
from tools.templates.workflow_api import load_workflow, ui_to_api

log = logging.getLogger("device_control.tools")
WORKFLOW = REPO / "workflows" / "01 Start here - SD1.5 moved to the GPU, then offloaded.json"
NOISE_NOTE = (
    "[Device Control] the image is noise by design: the demo's synthetic checkpoint has random weights. For a real "
    "image, put v1-5-pruned-emaonly-fp16.safetensors (https://huggingface.co/Comfy-Org/stable-diffusion-v1-5-archive) "
    "in ComfyUI's models/checkpoints and open the template %s in ComfyUI's template browser."
)


def _gpu_present() -> bool:
    probe = "import torch; print(torch.cuda.is_available() or torch.backends.mps.is_available())"
    done = subprocess.run([str(venv_python()), "-c", probe], capture_output=True, text=True, check=False)
    return done.stdout.strip() == "True"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _port(wanted: int) -> int:
    """``wanted`` if nothing listens there, else a free port."""
    try:
        with socket.create_connection(("127.0.0.1", wanted), timeout=0.5):
            return free_port()
    except OSError:
        return wanted


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n    python3")[0],  # whole paragraphs, not the usage lines
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--no-serve", action="store_true", help="stop ComfyUI after the run")
    parser.add_argument("--port", type=int, default=8188, help="port for ComfyUI (a free one if taken)")
    parser.add_argument(
        "--simulate-gpu",
        metavar="SIZE",
        help="add a simulated GPU of SIZE (default: 8GiB on a machine without a GPU; 'none' for none)",
    )
    parser.add_argument("--workflow", type=Path, default=WORKFLOW, help="a UI-format workflow to run")
    parser.add_argument(
        "--comfyui",
        default=DEFAULT_VERSION,
        choices=TESTED_VERSIONS,
        help=f"which ComfyUI to run (default {DEFAULT_VERSION}, or DEVICE_CONTROL_COMFYUI); those built from source "
        "need their archives beside the repository, as the tests do",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.monotonic()
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):  # every way of stopping the demo this OS has (no SIGHUP on Windows)
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), _interrupt)  # stops its ComfyUI too

    provision(args.comfyui)
    log.info("[Device Control] making the synthetic SD1.5 checkpoint (cached after the first run)")
    fixtures_env = {**os.environ, "DEVICE_CONTROL_COMFYUI": args.comfyui}
    command = [str(venv_python()), "-m", "tools.fixtures.make", "--without-families"]
    subprocess.run(command, cwd=REPO, check=True, env=fixtures_env)
    gpu = _gpu_present()
    simulate = args.simulate_gpu or (None if gpu else "8GiB")
    if simulate and simulate.lower() != "none":
        log.info("[Device Control] a simulated %s GPU is added after any real one; it computes on the CPU", simulate)
    env = {"DEVICE_CONTROL_SIMULATE_GPU": simulate} if simulate and simulate.lower() != "none" else {}
    base = runtime_dir() / ("demo" if args.comfyui == DEFAULT_VERSION else f"demo-{args.comfyui}")
    server = ComfyServer(base, env=env, port=_port(args.port), cpu=not gpu, version=args.comfyui)
    log.info("[Device Control] starting ComfyUI on %s (log: %s)", server.url, server.log_path)
    server.start()
    try:
        prompt = ui_to_api(load_workflow(args.workflow), server.get("/object_info"))
        entry = server.run(prompt)
        for node_id in sorted(prompt, key=int):
            outputs = entry["outputs"].get(node_id, {})
            for text in outputs.get("text", []):
                log.info("\n%s", text)
            for image in outputs.get("images", []):
                path = server.base / image["type"] / image["subfolder"] / image["filename"]
                log.info("\n[Device Control] image saved: %s", path)
                log.info(NOISE_NOTE, args.workflow.stem)
        log.info("\n[Device Control] demo finished in %.0f s", time.monotonic() - started)
        if args.no_serve:
            return 0
        log.info(
            "[Device Control] ComfyUI with Device Control runs at %s - open it in a browser; Ctrl-C stops it",
            server.url,
        )
        while server.process.poll() is None:
            time.sleep(1)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
