"""What a user is told when a prompt with our nodes is queued, in a real ComfyUI on a simulated GPU: values refused
whole and on the input at fault, warnings for a device this machine lacks or an Offload To CPU wired after nothing,
the cost of a large image on the CPU, and a cached placing node's text of where its models are now. The module
shares Move To GPU's server (tests/integration/test_move_offload.py): the same name and settings, one process."""

from __future__ import annotations

import contextlib
import time

import pytest

from tests.integration.executions import watch
from tests.integration.test_move_offload import MOVE, cycles_prompt, text, unet
from tests.passes import ONCE
from tools.runtime.server import ComfyError

HOLDS_MODELS = True


@pytest.fixture(scope="module")
def server(servers, server_pool):
    """Move To GPU's module's server (the same name and settings: shared where both run in one pytest)."""
    server_pool.stop_idle()
    return servers("move-8g", SIMULATE_GPU="8GiB")


def test_bad_budgets_and_devices_are_clear_and_the_server_keeps_serving(server, api):
    prompt = api.load_prompt(server, MOVE)
    prompt["3"]["inputs"]["vram_budget"] = "lots"
    with pytest.raises(ComfyError, match="Accepted forms"):  # refused when queued
        server.run(prompt)
    prompt["3"]["inputs"]["vram_budget"] = "20GB"  # a size the device lacks: known when the node runs
    with pytest.raises(ComfyError, match=r"larger than gpu:0, which holds 8.00 GiB; use at most that"):
        server.run(prompt)
    prompt["3"]["inputs"].update(vram_budget="all", device="gpu:7")
    entry = server.run(prompt)
    assert "device 'gpu:7' does not exist on this machine" in text(entry, "3")
    assert api.moves_hold(entry, prompt) == ["3"]  # it fell back to gpu:0, and is there
    assert unet(entry, api, "4")["resident"] == {"gpu:0": unet(entry, api, "4")["total_bytes"]}
    assert server.get("/system_stats")["system"]  # still serving


def test_a_malformed_device_is_refused_when_queued_naming_the_device(server, api):
    prompt = api.load_prompt(server, MOVE)
    prompt["3"]["inputs"].update(device="tpu:0", vram_budget="2GB")
    watched = watch(server, prompt)
    assert not watched.prompt_id and not watched.executed, "the prompt ran"
    # One error, on the input at fault (ComfyUI's own check files a refusal under every input the node's check
    # takes: the budget too), and a toast in the pack's words naming the node.
    [error] = watched.node_errors["3"]["errors"]
    assert error["extra_info"]["input_name"] == "device" and "tpu:0" in error["details"], error
    [toast] = [w for w in watched.warnings if w.get("severity") == "error"]
    assert toast["node"] == "3" and toast["title"] == "Move To GPU" and toast["text"] == error["details"]


@ONCE  # the pack's own check, the same on every ComfyUI
def test_a_refused_value_runs_nothing_of_the_graph(server, api):
    """The starter's first VRAM Report reads only the loader: ComfyUI would run it, and load the checkpoint, while
    refusing the Move To GPU after it. Refused by the pack when queued, nothing is queued."""
    prompt = api.load_prompt(server, MOVE)
    prompt["3"]["inputs"]["vram_budget"] = "150%"
    watched = watch(server, prompt)
    assert not watched.prompt_id and not watched.executed and list(watched.node_errors) == ["3"]
    assert watched.error["type"] == "prompt_outputs_failed_validation"  # ComfyUI's answer: the frontends read it
    assert server.get("/system_stats")["system"]  # still serving


@pytest.mark.parametrize(
    ("node", "name", "value", "said"),
    [
        ("1", "ckpt_name", "never_there.safetensors", "press R"),
        ("1", "model_dtype", "fp4", "pick one from the list"),
        ("1", "vae_dtype", "fp8_e4m3fn", "the VAE cannot be stored in fp8_e4m3fn"),
    ],
    ids=["checkpoint", "dtype", "vae-dtype"],
)
def test_a_loader_value_not_in_its_list_is_refused_when_queued_on_that_input(server, api, node, name, value, said):
    """ComfyUI 0.3.75 checks no list input of a node of the V3 API: a checkpoint that was never there failed only
    when the loader ran, as a file deleted after queueing. Every version now refuses it when queued, on its input."""
    prompt = api.load_prompt(server, MOVE)
    prompt[node]["inputs"][name] = value
    watched = watch(server, prompt)
    assert not watched.prompt_id and not watched.executed and list(watched.node_errors) == [node]
    [error] = watched.node_errors[node]["errors"]
    assert error["extra_info"]["input_name"] == name and said in error["details"] and value in error["details"]
    [toast] = [w for w in watched.warnings if w.get("severity") == "error"]
    assert toast["title"] == "Load Checkpoint With Device" and toast["text"] == error["details"]


def _after_a_loader(class_type: str, inputs: dict) -> dict:
    """A loader in RAM, node ``3`` of ``class_type`` on its MODEL with ``inputs``, and a report after it: its only
    output."""
    prompt = cycles_prompt(0)
    prompt["3"] = {"class_type": class_type, "inputs": {"model": ["1", 0], **inputs}}
    prompt["9"]["inputs"]["value"] = ["3", 0]
    return prompt


def one_move(**inputs) -> dict:
    """Move To GPU after a loader in RAM (see :func:`_after_a_loader`)."""
    defaults = {"device": "gpu:0", "vram_budget": "all", "keep_resident": False}
    return _after_a_loader("DeviceControl_MoveToGPU", defaults | inputs)


def offloaded(**inputs) -> dict:
    """Offload To CPU after a loader in RAM."""
    defaults = {"mode": "free N GB", "free_amount": "1GB", "empty_cache": True}
    return _after_a_loader("DeviceControl_OffloadToCPU", defaults | inputs)


def split(**inputs) -> dict:
    """Split Model Across Devices after a loader in RAM."""
    return _after_a_loader("DeviceControl_SplitModel", {"allocation": "auto", "mode": "pipeline"} | inputs)


@pytest.mark.parametrize(
    ("build", "name", "said"),
    [
        (one_move, "vram_budget", "VRAM budget"),
        (offloaded, "free_amount", "is not a memory size"),
        (split, "allocation", "in allocation"),
    ],
    ids=["move-budget", "offload-amount", "split-allocation"],
)
@pytest.mark.parametrize("value", ["abc", "150%"])
def test_sizes_budgets_and_allocations_are_refused_when_queued_before_anything_loads(server, build, name, said, value):
    watched = watch(server, build(**{name: value}))
    assert not watched.prompt_id and not watched.executed, "the prompt ran"
    [error] = watched.node_errors["3"]["errors"]  # one, on the input at fault
    assert error["extra_info"]["input_name"] == name and said in error["details"], error
    assert repr(value) in error["details"] and ("write it" in error["details"] or "must be a share" in error["details"])
    assert [w["text"] for w in watched.warnings if w.get("severity") == "error"] == [error["details"]]


@ONCE  # the pack's own check, the same on every ComfyUI
def test_a_large_image_on_the_cpu_says_what_it_costs_and_what_to_lower_when_queued(server):
    """ComfyUI computes on the CPU here (the simulated GPU computes on the host too): a 512x512 image is about 42 s
    a step on a 2-core machine, and nothing on the canvas said so; a 64x64 one is not worth a notice."""
    latent = {"class_type": "EmptyLatentImage", "inputs": {"width": 512, "height": 512, "batch_size": 1}}
    report = {"class_type": "DeviceControl_VRAMReport", "inputs": {"label": "", "devices": "all", "value": ["1", 0]}}
    watched = watch(server, {"1": latent | {"_meta": {"title": "Empty Latent Image"}}, "2": report})
    [told] = [w for w in watched.warnings if w["node"] == "1"]
    assert told["title"] == "Empty Latent Image" and told["severity"] == "warn", told
    assert "computes on the CPU here" in told["text"] and "at 512x512 an SD1.5 step takes about 42 s" in told["text"]
    assert "set the size to 256x256 and the steps to 4" in told["text"], told
    latent["inputs"].update(width=64, height=64)
    assert not [w for w in watch(server, {"1": latent, "2": report}).warnings if w["node"] == "1"]


def test_a_cached_placing_node_says_where_its_model_is_now(server):
    """Queued again unchanged, the loader and Move To GPU come from ComfyUI's cache and do not run: each still
    says where its models are now (ComfyUI shows a cached node's text only for an output node, from its run)."""
    prompt = one_move()
    server.forget_outputs()
    first = watch(server, prompt)
    assert {"1", "3"} <= set(first.executed), first.executed
    again = watch(server, prompt)
    assert {"1", "3"} <= set(again.cached) and not {"1", "3"} & set(again.executed), again.said
    moved, loader = again.outputs["3"], again.outputs["1"]
    assert moved["device_control_cached"] == [True] and loader["device_control_cached"] == [True]
    [text] = moved["text"]
    assert (
        text.startswith("From ComfyUI's cache (this node did not run)")
        and "GiB on gpu:0, placed by Device Control, budget all" in text
    ), text
    assert "text encoder" in loader["text"][0] and "VAE" in loader["text"][0], loader
    server.wait(again.prompt_id)
    for _ in range(50):  # the panel's Offload all, once ComfyUI's worker has let go of the prompt: the cache is kept
        with contextlib.suppress(ComfyError):
            server.post("/device_control/offload", {"all": True})
            break
        time.sleep(0.1)
    prompt["9"]["inputs"]["label"] = "after an offload"  # only the report runs again
    [text] = watch(server, prompt).outputs["3"]["text"]
    assert "GiB on cpu" in text and "on gpu:0" not in text, text


def test_a_device_this_machine_lacks_falls_back_alike_with_a_warning_when_queued(server, api):
    prompt = one_move(device="gpu:3")
    prompt["1"]["inputs"]["model_device"] = "gpu:3"
    watched = watch(server, prompt)
    entry = server.wait(watched.prompt_id)
    problem = "device 'gpu:3' does not exist on this machine"
    fallback = "using auto (ComfyUI's choice) instead"
    told = {(w["node"], w["title"]): w["text"] for w in watched.warnings}
    assert told[("1", "Load Checkpoint With Device")].startswith(f"model_device: {problem}"), told
    assert told[("3", "Move To GPU")].startswith(f"device: {problem}"), told
    assert all(t.endswith(fallback) for t in told.values()), told
    for node in ("1", "3"):  # the node's own report says the same, in the same words
        assert f"{problem} (devices here: " in text(entry, node) and f"; {fallback}" in text(entry, node)
    assert f"[Device Control] Move To GPU (node 3): device: {problem}" in server.log_tail(400)


def test_an_offload_wired_after_nothing_says_it_may_run_first(server):
    prompt = offloaded(mode="all models")
    del prompt["3"]["inputs"]["model"]
    watched = watch(server, prompt)
    entry = server.wait(watched.prompt_id)
    warned = [w for w in watched.warnings if w["node"] == "3"]
    assert warned and warned[0]["title"] == "Offload To CPU" and "may run it at any point" in warned[0]["text"]
    assert "warning: nothing is connected to its model or trigger input" in text(entry, "3")
    assert "[Device Control] Offload To CPU (node 3): nothing is connected" in server.log_tail(400)
