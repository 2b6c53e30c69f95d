"""Host work per streamed layer, with the copy itself made free: ours (the ring) against ComfyUI's cast path.

    .runtime/venv/bin/python -m tools.bench_host [LAYERS] [REPEATS]

On a real GPU a streamed step was bound by the host, not the link (``GPU_RUNS.md``): what decides it is the Python
work each streamed layer does to get its weights onto the device. This measures that work alone, on this machine's
CPU, for both casts of the same layers in one process, the variants in turns:

* ``plain``: ``torch.nn.Linear``, weights where the input is (the layer's own compute, nothing else);
* ``ComfyUI cast``: ``comfy.ops.manual_cast.Linear`` with ``comfy_cast_weights`` set, fp16 weights, as ComfyUI
  streams a layer it offloads (its cast path; the move to the device is a no-op here, the checks and casts are not);
* ``ours, ring``: the pack's cast layers streamed through ``core.placement.ring`` to the host's own backend, which
  has no streams: a group's copy is one small memcpy, everything else the ring does per layer and per group runs.

Layers are tiny (64x64, one token) so that the compute is small beside the host work; the host work per layer is
each variant's time less ``plain``'s, over the layers; torch runs on one thread. A figure is the best of
``REPEATS`` passes (on a shared machine the minimum is the least disturbed). Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

#: Layers a group holds: SDXL's streamed layers at a 1.5 GB budget average about eight a group.
LAYERS_PER_GROUP = 8
WIDTH = 64


def _best(run: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def host_cost(layers: int = 400, repeats: int = 30) -> dict:
    """Seconds per pass of ``layers`` layers for each variant, and the host work per layer (microseconds)."""
    from tools.comfy_inprocess import import_comfy

    import_comfy()
    import comfy.ops
    import torch

    from core.devices.backends import HOST
    from core.placement.ring import Ring
    from core.placement.slabs import layer_bytes
    from core.weights import ops

    torch.manual_seed(0)
    torch.set_num_threads(1)  # host work is one thread's; tiny copies split over threads only measure wake-ups
    plain = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    comfy_net = torch.nn.Sequential(
        *(comfy.ops.manual_cast.Linear(WIDTH, WIDTH, dtype=torch.float16) for _ in range(layers))
    )
    ours = torch.nn.Sequential(
        *(ops.without_init(ops.Linear)(WIDTH, WIDTH, dtype=torch.float16) for _ in range(layers))
    )
    for net in (comfy_net, ours):
        net.load_state_dict(plain.state_dict())
        for layer in net:
            layer.comfy_cast_weights = True
    ring = Ring()
    ring.attach(list(ours), HOST, 3 * LAYERS_PER_GROUP * layer_bytes(ours[0]))
    x = torch.randn(1, WIDTH)
    variants = {"plain": plain, "ComfyUI cast": comfy_net, "ours, ring": ours}
    seconds = dict.fromkeys(variants, float("inf"))
    with torch.inference_mode():
        for net in variants.values():
            net(x)  # warm up
        for _ in range(3):  # in turns, so drift hits every variant alike
            for name, net in variants.items():
                seconds[name] = min(seconds[name], _best(lambda net=net: net(x), repeats))
    per_layer = {name: (value - seconds["plain"]) / layers * 1e6 for name, value in seconds.items() if name != "plain"}
    return {
        "layers": layers,
        "groups": len(ring._groups),
        "pass_s": seconds,
        "host_us_per_layer": per_layer,
        "ratio": per_layer["ours, ring"] / per_layer["ComfyUI cast"],
        "torch": torch.__version__,
    }


def main() -> None:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    sys.stdout.write(json.dumps(host_cost(layers, repeats)) + "\n")


if __name__ == "__main__":
    main()
