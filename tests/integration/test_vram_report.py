"""VRAM Report on a real server: bad input is reported in the text, never a crashed prompt."""

from __future__ import annotations


def test_unknown_device_is_reported_and_all_devices_are_shown(comfy_server, api):
    entry = comfy_server.run(api.report_prompt(devices="gpu:7"))
    text = api.report_text(entry)
    assert "device 'gpu:7' does not exist on this machine" in text
    assert "Showing all devices." in text
    assert "cpu    CPU" in text


def test_malformed_device_is_reported_with_the_accepted_forms(comfy_server, api):
    text = api.report_text(comfy_server.run(api.report_prompt(devices="tpu:0")))
    assert "'tpu:0' is not a device; use one of: auto, cpu, gpu:N" in text
    assert "cpu    CPU" in text


def test_device_filter_and_label(comfy_server, api):
    entry = comfy_server.run(api.report_prompt(devices="cpu", label="  just the host  "))
    data = api.report_json(entry)
    assert [d["id"] for d in data["devices"]] == ["cpu"]
    assert data["label"] == "just the host"


def test_value_passes_through_unchanged(comfy_server, api):
    prompt = {
        "1": {"class_type": "PrimitiveInt", "inputs": {"value": 1234}},
        "2": {"class_type": "DeviceControl_VRAMReport", "inputs": {"label": "", "devices": "all", "value": ["1", 0]}},
        "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 0]}},
    }
    entry = comfy_server.run(prompt)
    assert entry["outputs"]["3"]["text"] == ["1234"]
    assert api.report_json(entry, "2")["subject"] is None  # an INT is not a model: nothing to describe


def test_report_runs_again_on_every_queue(comfy_server, api):
    for _ in range(2):  # the same prompt twice: ComfyUI would serve the second from its cache
        entry = comfy_server.run(api.report_prompt(label="again"))
        cached = [m[1]["nodes"] for m in entry["status"]["messages"] if m[0] == "execution_cached"]
        assert cached == [[]], "the VRAM Report was served from ComfyUI's cache instead of running"
