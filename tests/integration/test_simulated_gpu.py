"""A ComfyUI started with DEVICE_CONTROL_SIMULATE_GPU lists the simulated GPU; a failing device query
(injected) is reported in the text and the prompt still succeeds."""

from __future__ import annotations

from pathlib import Path

import pytest

GiB = 1024**3
TXT2IMG = Path(__file__).resolve().parents[2] / "workflows" / "03 Text to image with VRAM Reports.json"


@pytest.fixture(scope="module")
def simulated_server(servers):
    return servers("sim-base", SIMULATE_GPU="8GiB")


def test_simulated_gpu_is_listed_with_its_capacity_during_the_example_workflow(simulated_server, api):
    prompt = api.load_prompt(simulated_server, TXT2IMG)
    entry = simulated_server.run(prompt)
    for node_id, node in prompt.items():
        if node["class_type"] != "DeviceControl_VRAMReport":
            continue
        text = api.report_text(entry, node_id)
        assert "gpu:0  Simulated GPU 0 (8.00 GiB) [simulated]: 0 B used of 8.00 GiB; 8.00 GiB free" in text
        device = next(d for d in api.report_json(entry, node_id)["devices"] if d["id"] == "gpu:0")
        assert (device["kind"], device["total"], device["native"]) == ("simulated", 8 * GiB, "sim:0")
    started = simulated_server.log_path.read_text(errors="replace")  # from the start: a shared server logs more
    # Named as the nodes name it (its torch name, sim:0, only in the VRAM Report's JSON): one name for each device.
    assert "[Device Control] simulated GPU gpu:0 with 8.00 GiB" in started and "sim:0" not in started


def test_simulated_gpu_is_offered_as_a_device(simulated_server):
    info = simulated_server.get("/object_info/DeviceControl_VRAMReport")["DeviceControl_VRAMReport"]
    assert info["input"]["required"]["devices"][1]["options"] == ["all", "cpu", "gpu:0"]


def test_a_device_query_that_raises_is_reported_and_the_prompt_succeeds(comfy_factory, tmp_path, api):
    env = {"DEVICE_CONTROL_SIMULATE_GPU": "4GiB", "DEVICE_CONTROL_SIMULATE_FAULTS": "stats"}
    server = comfy_factory(tmp_path / "fault-base", env=env)
    try:
        entry = server.run(api.report_prompt())
        text = api.report_text(entry)
        assert "query failed: RuntimeError: sim:0: injected fault: memory statistics query failed" in text
        assert "cpu    CPU" in text  # the other devices are still reported
        # the next prompt works too: the server keeps serving
        assert "Devices:" in api.report_text(server.run(api.report_prompt(label="next")))
    finally:
        server.stop()


OFFLOAD = {"mode": "all models", "free_amount": "1GB", "empty_cache": True}


def test_invalid_settings_are_logged_with_the_fix_and_comfyui_still_starts(comfy_factory, tmp_path, api):
    env = {
        "DEVICE_CONTROL_SIMULATE_GPU": "eight gigs",
        "DEVICE_CONTROL_MAX_PINNED_FRACTION": "most",
        "DEVICE_CONTROL_PREFETCH": "sometimes",
    }
    server = comfy_factory(tmp_path / "bad-env-base", env=env)
    try:
        log = server.log_tail(2000)
        assert "DEVICE_CONTROL_SIMULATE_GPU is invalid" in log and "Example: DEVICE_CONTROL_SIMULATE_GPU=8GiB" in log
        assert "DEVICE_CONTROL_MAX_PINNED_FRACTION='most' is not a share of RAM from 0 to 1" in log
        assert "write it like DEVICE_CONTROL_MAX_PINNED_FRACTION=0.45" in log and "stays capped at 45 %" in log
        assert "DEVICE_CONTROL_PREFETCH='sometimes' is neither on nor off" in log and "Prefetch stays on" in log
        text = api.report_text(server.run(api.report_prompt()))
        assert "simulated" not in text
        move = {
            "1": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
            "2": {"class_type": "DeviceControl_OffloadToCPU", "inputs": {"trigger": ["1", 0], **OFFLOAD}},
        }
        assert "Offload To CPU (all models)" in server.run(move)["outputs"]["2"]["text"][0]  # moves still work
    finally:
        server.stop()


def test_an_invalid_simulation_setting_is_logged_and_comfyui_still_starts(comfy_factory, tmp_path, api):
    env = {"DEVICE_CONTROL_SIMULATE_GPU": "8GiB", "DEVICE_CONTROL_SIMULATE_LINK": "fast"}
    server = comfy_factory(tmp_path / "bad-link-base", env=env)
    try:
        log = server.log_tail(2000)
        assert "DEVICE_CONTROL_SIMULATE_LINK='fast'" in log  # the problem, with the text as written
        assert "write it like DEVICE_CONTROL_SIMULATE_LINK=16GB/s,10us" in log  # and the fix
        assert api.report_text(server.run(api.report_prompt()))  # ComfyUI started and runs a prompt
    finally:
        server.stop()
