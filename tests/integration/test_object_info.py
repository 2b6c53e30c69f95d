"""ComfyUI lists our nodes, with the names, category, description and tooltips users see."""

from __future__ import annotations

from urllib.parse import quote

import pytest

from tools.fixtures.make import SD15_CLIP_L
from tools.runtime.server import ComfyError

#: A type only a template-following input or output has; the node's Info would show it as such.
MATCH_TYPE = "COMFY_MATCHTYPE_V3"
#: The types Move To GPU and Offload To CPU take (``nodes.bridge.subjects.PLACEABLE_KINDS``).
TAKES = "MODEL,CLIP,VAE,CONTROL_NET,CLIP_VISION,UPSCALE_MODEL,MODEL_PATCH,GLIGEN"


def test_our_nodes_are_registered_with_descriptions_and_tooltips(comfy_server, api):
    info = comfy_server.get("/object_info")
    for node_id, display_name in api.our_nodes.items():
        assert node_id in info, f"{node_id} is not registered; server log:\n{comfy_server.log_tail()}"
        node = info[node_id]
        assert node["display_name"] == display_name
        assert node["category"] == "Device Control"
        assert len(node["description"]) > 40
        for section in ("required", "optional"):
            for name, spec in node["input"].get(section, {}).items():
                assert spec[1].get("tooltip"), f"{node_id}.{name} has no tooltip"
        assert len(node["output_tooltips"]) == len(node["output"])
        assert all(node["output_tooltips"]), f"{node_id} has an output without a tooltip"


def test_vram_report_is_an_output_node_that_always_runs(comfy_server):
    node = comfy_server.get("/object_info/DeviceControl_VRAMReport")["DeviceControl_VRAMReport"]
    assert node["output_node"] is True
    assert node["output"] == ["*", "STRING", "STRING"]
    assert node["input"]["optional"]["value"][0] == "*"
    assert node["input"]["required"]["devices"][1]["options"][:2] == ["all", "cpu"]


def test_the_pack_loads_without_errors_and_serves_its_web_extension(comfy_server):
    log = comfy_server.log_tail(2000)
    timing = [line for line in log.splitlines() if line.rstrip().endswith("custom_nodes/comfyui-device-control")]
    assert timing, "ComfyUI did not list the pack among its custom nodes"
    assert "IMPORT FAILED" not in timing[0]
    assert "Error while calling comfy_entrypoint" not in log
    extensions = comfy_server.get("/extensions")
    assert "/extensions/comfyui-device-control/device_control.js" in extensions


def test_example_workflows_are_offered_as_templates_in_the_order_of_their_numbers(comfy_server, api):
    """The template browser's default sort keeps the server's order, which ComfyUI takes from the disk (hash order
    on Linux: "01 Start here" came last); the titles are the file names."""
    for path in ("/workflow_templates", "/api/workflow_templates"):
        templates = comfy_server.get(path)
        assert templates["comfyui-device-control"] == sorted(w.stem for w in api.workflows), path
    assert templates["comfyui-device-control"][0].startswith("01 Start here")
    for workflow in api.workflows:
        served = comfy_server.get(f"/api/workflow_templates/comfyui-device-control/{quote(workflow.name)}")
        assert served["nodes"], f"{workflow.name} is not served to the frontend's template browser"
        assert served["extra"]["device_control_template"] is True  # it opens readable (web/template_view.js)


def test_move_and_offload_take_any_model_and_pass_a_trigger_through(comfy_server):
    info = comfy_server.get("/object_info")
    move, offload = info["DeviceControl_MoveToGPU"], info["DeviceControl_OffloadToCPU"]
    assert move["input"]["required"]["model"][0] == TAKES
    assert move["output"][1:] == ["*", "STRING"]
    assert move["input"]["optional"]["trigger"][0] == "*"
    assert move["input"]["required"]["device"][1]["options"][0] == "auto"
    assert offload["output_node"] is True and offload["output"] == ["*", "STRING"]
    assert offload["input"]["optional"]["model"][0] == TAKES
    modes = offload["input"]["required"]["mode"][1]["options"]
    assert modes == ["full", "free N GB", "all models", "all except this one"]


def test_our_loaders_offer_every_dtype_and_text_encoder_type_the_running_comfyuis_loaders_offer(comfy_server):
    info = comfy_server.get("/object_info")
    ours = info["DeviceControl_LoadDiffusionModel"]["input"]["required"]["dtype"][1]["options"]
    stock = info["UNETLoader"]["input"]["required"]["weight_dtype"]
    stock = stock[1]["options"] if stock[0] == "COMBO" else stock[0]
    assert {"default" if o == "auto" else o for o in ours} >= set(stock)
    types = info["DeviceControl_LoadTextEncoders"]["input"]["required"]["type"][1]["options"]
    for loader in ("CLIPLoader", "DualCLIPLoader"):
        offered = info[loader]["input"]["required"]["type"]
        assert set(types) >= set(offered[1]["options"] if offered[0] == "COMBO" else offered[0]), loader
    vae = info["DeviceControl_LoadVAE"]["input"]["required"]["dtype"][1]["options"]
    assert vae == ["auto", "fp32", "fp16", "bf16"]


def _defaults(node: dict) -> dict:
    """The inputs a node dropped in fresh carries: each required widget's default."""
    return {name: spec[1]["default"] for name, spec in node["input"]["required"].items() if "default" in spec[1]}


def test_no_node_offers_a_choice_it_then_refuses(comfy_server):
    info = comfy_server.get("/object_info")
    # A VAE has no cast path: the checkpoint loader offers for it what Load VAE With Device offers, no fp8.
    checkpoint = info["DeviceControl_LoadCheckpoint"]["input"]["required"]
    assert (
        checkpoint["vae_dtype"][1]["options"]
        == info["DeviceControl_LoadVAE"]["input"]["required"]["dtype"][1]["options"]
    )
    assert not [o for o in checkpoint["vae_dtype"][1]["options"] if "fp8" in o]
    assert [o for o in checkpoint["model_dtype"][1]["options"] if "fp8" in o]  # the diffusion model keeps them
    # Split Model shares out a MODEL or a CLIP; a VAE cannot be wired into it.
    assert info["DeviceControl_SplitModel"]["input"]["required"]["model"][0] == "MODEL,CLIP"
    # Offload To CPU dropped in fresh needs nothing connected, and says which mode reads free_amount.
    offload = info["DeviceControl_OffloadToCPU"]["input"]
    assert offload["required"]["mode"][1]["default"] == "all models"
    assert "free N GB' only" in offload["required"]["free_amount"][1]["tooltip"]


def test_a_fresh_offload_to_cpu_runs_and_says_when_free_amount_is_not_read(comfy_server):
    node = comfy_server.get("/object_info/DeviceControl_OffloadToCPU")["DeviceControl_OffloadToCPU"]
    fresh = comfy_server.run({"1": {"class_type": "DeviceControl_OffloadToCPU", "inputs": _defaults(node)}})
    summary = fresh["outputs"]["1"]["text"][0]
    assert summary.startswith("Offload To CPU (all models)") and "was not read" not in summary
    changed = _defaults(node) | {"free_amount": "1GB"}
    ignored = comfy_server.run({"1": {"class_type": "DeviceControl_OffloadToCPU", "inputs": changed}})
    assert "free_amount '1GB' was not read: only mode 'free N GB' reads it." in ignored["outputs"]["1"]["text"][0]


def test_move_to_gpu_reads_as_the_types_it_takes_on_every_comfyui(comfy_server):
    # The editor narrows the output to the type connected to the input (web/panel/device_warnings.js, tested in
    # tests/browser/test_move_types.py); what ComfyUI lists, and the node's Info shows, is readable everywhere.
    move = comfy_server.get("/object_info/DeviceControl_MoveToGPU")["DeviceControl_MoveToGPU"]
    model = move["input"]["required"]["model"]
    assert model[0] == TAKES and "template" not in model[1]
    assert move["output"][0] == TAKES and move["output_name"][0] == "model"
    assert MATCH_TYPE not in move["output"] and not any(move.get("output_matchtypes") or [])
    assert model[1]["tooltip"] and move["output_tooltips"][0]
    offload = comfy_server.get("/object_info/DeviceControl_OffloadToCPU")["DeviceControl_OffloadToCPU"]
    assert offload["input"]["optional"]["model"][0] == TAKES  # no model output: nothing to follow


def _moved_clip_prompt(encoder: str = "CLIPTextEncode") -> dict:
    """A CLIP loaded by ComfyUI's CLIP loader, moved, and encoded; a VRAM Report makes it run."""
    return {
        "1": {"class_type": "CLIPLoader", "inputs": {"clip_name": SD15_CLIP_L, "type": "stable_diffusion"}},
        "2": {
            "class_type": "DeviceControl_MoveToGPU",
            "inputs": {"model": ["1", 0], "device": "auto", "vram_budget": "all", "keep_resident": False},
        },
        "3": {"class_type": encoder, "inputs": {"clip": ["2", 0], "text": "a moved text encoder"}},
        "4": {"class_type": "DeviceControl_VRAMReport", "inputs": {"label": "", "devices": "all", "value": ["3", 0]}},
    }


def test_a_clip_moved_by_move_to_gpu_feeds_clip_text_encode(comfy_server, api):
    entry = comfy_server.run(_moved_clip_prompt())
    assert "resident on" in entry["outputs"]["2"]["text"][0]
    assert api.report_json(entry, "4")["label"] == ""


@pytest.mark.parametrize(
    ("name", "problem"),
    [("model", r"CONDITIONING.*MODEL,CLIP,VAE"), ("vram_budget", r"CONDITIONING.*STRING")],
)
def test_move_to_gpu_refuses_a_link_of_the_wrong_type_when_queued(comfy_server, name, problem):
    """ComfyUI's own check lets any link into a template's input: where one is used, the node checks them."""
    prompt = _moved_clip_prompt()
    prompt["3"]["inputs"]["clip"] = ["1", 0]
    prompt["2"]["inputs"][name] = ["3", 0]  # the encoder's CONDITIONING, where a model or a budget goes
    prompt["4"]["inputs"]["value"] = ["2", 2]  # the report runs after the move (only what an output needs is checked)
    with pytest.raises(ComfyError, match=problem):
        comfy_server.queue(prompt)
