"""A model patch or GLIGEN placed on another device than the diffusion model it computes inside: refused when the
prompt is queued, with the fix.

ComfyUI calls a model patch (the ControlNets of Qwen-Image and Z-Image, USO's projector) and GLIGEN from inside
its diffusion model's forward, through their methods, with that model's tensors: on another device they meet in a
device mismatch mid-sampling. A ControlNet is called through its forward, which the pack's crossing serves
(``core.placement.crossing``); these are not, so the prompt is read instead. Each placement of a patch (Move To GPU
on a patch's wire, Load Model Patch With Device) is followed downstream to the nodes that use it with a MODEL
(the patch node itself, or the sampler its conditioning reaches), and that MODEL upstream to its placement (Move To
GPU, or our loader's device). Two devices written out that differ are refused on the patch's node; ``auto``, or a
model whose placement the prompt does not say, is left to run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..core.devices.inventory import parse_device_spec
from ..core.errors import InvalidDeviceSpecError

#: The nodes that give out a model patch or GLIGEN (output 0), and its kind as the refusal names it.
PATCH_SOURCES = {
    "ModelPatchLoader": "model patch",
    "GLIGENLoader": "GLIGEN model",
    "DeviceControl_LoadModelPatch": "model patch",
}
#: Our nodes that place what comes in on ``model`` and give it out at output 0.
PLACERS = frozenset({"DeviceControl_MoveToGPU"})
#: Our nodes that give out at output 0 what comes in on an input, unchanged, by the input's name.
PASSING = {"DeviceControl_MoveToGPU": "model", "DeviceControl_VRAMReport": "value"}
#: Our loaders, and the input naming the device of the model at output 0.
LOADER_DEVICES = {
    "DeviceControl_LoadCheckpoint": "model_device",
    "DeviceControl_LoadDiffusionModel": "device",
    "DeviceControl_LoadModelPatch": "device",
}

Prompt = dict[str, Any]


def _link(value: Any) -> tuple[str, int] | None:
    return (str(value[0]), int(value[1])) if isinstance(value, list) and len(value) == 2 else None


def _origin(prompt: Prompt, node_id: str) -> tuple[str, str | None]:
    """The node a value placed at ``node_id`` comes from (through placers and reports), and the device the nearest
    placement on the way (``node_id``'s own first) writes: ``None`` where it says ``auto``, or none does."""
    device, placed = None, False
    while node_id in prompt:
        entry = prompt[node_id]
        kind, inputs = entry.get("class_type"), entry.get("inputs") or {}
        if kind in PLACERS and not placed:
            device, placed = _written(inputs.get("device")), True
        elif kind in LOADER_DEVICES and not placed:
            device = _written(inputs.get(LOADER_DEVICES[kind]))
        upstream = _link(inputs.get(PASSING[kind])) if kind in PASSING else None
        if upstream is None:
            break
        node_id = upstream[0]
    return node_id, device


def _written(value: Any) -> str | None:
    """A device the prompt writes out (not ``auto``, not linked), as one key for every name of it."""
    if not isinstance(value, str):
        return None
    try:
        spec = parse_device_spec(value)
    except InvalidDeviceSpecError:
        return None  # the node's own check refuses it
    if spec.kind == "auto":
        return None
    return "cpu" if spec.kind == "cpu" else f"gpu:{spec.index}"


def _users(prompt: Prompt, node_id: str) -> Iterator[str]:
    """The nodes that read an output of ``node_id`` as a value: a ``trigger`` input only orders two nodes."""
    for other, entry in prompt.items():
        inputs = (entry.get("inputs") or {}).items()
        if any((_link(value) or ("",))[0] == node_id for name, value in inputs if name != "trigger"):
            yield str(other)


def _models_it_reaches(prompt: Prompt, node_id: str, patch: str) -> Iterator[tuple[str, int]]:
    """The MODEL inputs of the nodes the value at ``node_id`` reaches (downstream, stopping at the first node that
    also takes a MODEL on each way). A node whose ``model`` is the patch from ``patch`` itself is no diffusion
    model: Offload To CPU is passed through (the placement holds for the next use), and a move of it again ends
    the way (that placement is checked on its own)."""
    seen, todo = set(), list(_users(prompt, node_id))
    while todo:
        user = todo.pop()
        if user in seen:
            continue
        seen.add(user)
        model = _link((prompt[user].get("inputs") or {}).get("model"))
        if model is None:
            todo += _users(prompt, user)
        elif _origin(prompt, model[0])[0] != patch:
            yield model
        elif prompt[user].get("class_type") not in PLACERS:
            todo += _users(prompt, user)


def patch_device_problems(prompt: Prompt) -> dict[str, str]:
    """For each node that places a model patch or GLIGEN on another device than a diffusion model it computes
    inside, the refusal, by node id (empty: none)."""
    problems = {}
    for node_id, entry in prompt.items():
        if not isinstance(entry, dict) or entry.get("class_type") not in PLACERS | set(LOADER_DEVICES):
            continue
        origin, device = _origin(prompt, str(node_id))
        noun = PATCH_SOURCES.get(prompt.get(origin, {}).get("class_type"))
        if noun is None or device is None:
            continue
        for model_node, _slot in _models_it_reaches(prompt, str(node_id), origin):
            model_origin, model_device = _origin(prompt, model_node)
            if model_device is not None and model_device != device:
                problems[str(node_id)] = (
                    f"device: this {noun} is placed on {device}, but the diffusion model it computes inside (from "
                    f"node {model_origin}) is on {model_device}: ComfyUI calls it from inside that model's steps, "
                    f"with that model's tensors. Place it on {model_device} too."
                )
    return problems
