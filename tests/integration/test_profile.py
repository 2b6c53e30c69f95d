"""The memory profile in a real ComfyUI on a simulated GPU: every node of the example that moves the UNet to the
GPU and back, with the bytes its VRAM Reports saw at that moment; the profile pushed to the prompt's client; a
cached run; a failing run; and the route's answers to bad queries."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import aiohttp
import pytest

from tools.bench.stress import run_coroutine
from tools.runtime.server import ComfyError

REPO = Path(__file__).resolve().parents[2]
MOVE = REPO / "workflows" / "01 Start here - SD1.5 moved to the GPU, then offloaded.json"
GiB = 1024**3


@pytest.fixture(scope="module")
def server(servers):
    return servers("profile-8g", SIMULATE_GPU="8GiB")


def status_of(server, path: str) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(server.url + path, timeout=30) as response:
            body = response.read().decode()
            is_json = response.headers.get_content_type() == "application/json"
            return response.status, json.loads(body) if is_json else body
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


async def _run_and_listen(server, prompt: dict) -> tuple[str, list[dict]]:
    """Queue ``prompt`` from a websocket client; the profiles pushed to it until the prompt has ended."""
    client, received = uuid.uuid4().hex, []
    async with aiohttp.ClientSession() as session, session.ws_connect(f"{server.url}/ws?clientId={client}") as ws:
        prompt_id = await asyncio.to_thread(server.queue, prompt, client)
        deadline = time.monotonic() + 300
        while (left := deadline - time.monotonic()) > 0 and not received:
            message = await ws.receive(timeout=left)
            if message.type == aiohttp.WSMsgType.TEXT and json.loads(message.data)["type"] == "device_control.profile":
                received.append(json.loads(message.data)["data"])
    return prompt_id, received


def _unet_off_gpu(entry: dict, api, node: str) -> int:
    report = api.report_json(entry, node)
    unet = next(m for m in report["models"] if m["component"] == "MODEL")
    return dict(unet["resident"]).get("cpu", 0)


def _unet_on_gpu(entry: dict, api, node: str) -> int:
    report = api.report_json(entry, node)
    unet = next((m for m in report["models"] if m["component"] == "MODEL"), None)  # none once it is offloaded
    return 0 if unet is None else dict(unet["resident"]).get("gpu:0", 0)


def test_every_node_is_profiled_with_the_bytes_the_books_held(server, api):
    prompt = api.load_prompt(server, MOVE)
    prompt["12"]["inputs"]["profile"] = True  # the last VRAM Report ends with the heaviest node so far
    prompt_id, pushed = run_coroutine(_run_and_listen(server, prompt))
    entry = server.wait(prompt_id)
    profile = server.get("/device_control/profile")
    assert pushed and pushed[0]["prompt_id"] == prompt_id == profile["prompt_id"] and profile["status"] == "success"
    nodes = {node["node"]: node for node in profile["nodes"]}
    assert set(nodes) == set(prompt) and all(n["status"] == "executed" for n in nodes.values())
    assert nodes["8"]["class_type"] == "KSampler" and nodes["8"]["wall"] > 0
    placed = _unet_on_gpu(entry, api, "4")  # the report right after Move To GPU
    assert placed > 3 * GiB
    move, offload = nodes["3"], nodes["9"]
    assert move["after"]["gpu:0"] - move["before"]["gpu:0"] >= placed  # the UNet's bytes arrived with it
    assert [(e["kind"], e["after"].get("gpu:0")) for e in move["events"] if e["after"].get("gpu:0")] == [
        ("loaded", placed)
    ]
    assert _unet_on_gpu(entry, api, "10") == 0  # the report after Offload To CPU
    assert offload["before"]["gpu:0"] - offload["after"]["gpu:0"] >= placed
    assert [(e["kind"], e["bytes"]) for e in offload["events"]] == [("offloaded", placed)]
    assert nodes["8"]["peak"]["gpu:0"] >= placed  # the sampler ran with the UNet on the GPU
    # What each node did: Move To GPU raised gpu:0 by the UNet; the sampler, beside it, by little of its own.
    assert move["device"] == "gpu:0" and move["rise"]["gpu:0"] >= placed
    assert nodes["8"]["rise"]["gpu:0"] < 256 * 1024**2 and nodes["7"]["device"] == "cpu"
    rises = sorted(((n["rise"][n["device"]], key) for key, n in nodes.items()), reverse=True)
    assert rises[0][0] > rises[1][0] and profile["heaviest"] == {
        "node": rises[0][1],
        "device": nodes[rises[0][1]]["device"],
    }
    heaviest = nodes[rises[0][1]]
    line = api.report_text(entry, "12").splitlines()[-1]
    assert line.startswith(f"heaviest node so far: {heaviest['title']} ({heaviest['node']}), "), line
    table = status_of(server, f"/device_control/profile?prompt_id={prompt_id}&format=markdown")[1]
    assert "| KSampler (8) | KSampler | executed |" in table


def test_a_budget_placement_is_partially_loaded_and_the_sampler_streams_the_rest(server, api):
    prompt = api.load_prompt(server, MOVE)
    prompt["3"]["inputs"]["vram_budget"] = "1.5GB"
    prompt_id = server.queue(prompt)
    entry = server.wait(prompt_id)
    nodes = {node["node"]: node for node in server.get(f"/device_control/profile?prompt_id={prompt_id}")["nodes"]}
    placed = _unet_on_gpu(entry, api, "4")
    assert GiB < placed <= 1.5 * GiB
    assert [(e["kind"], e["after"]["gpu:0"]) for e in nodes["3"]["events"]] == [("partially loaded", placed)]
    streamed = [e for e in nodes["8"]["events"] if e["kind"] == "streamed"]
    # The one sampling step casts the layers left in RAM onto the GPU for their use: most of the UNet's bytes
    # not resident (the layers its forward pass uses), never more than the whole UNet.
    assert len(streamed) == 1 and streamed[0]["model"] == "SD15 diffusion model", streamed
    total = _unet_on_gpu(entry, api, "4") + _unet_off_gpu(entry, api, "4")
    assert 0.8 * (total - placed) <= streamed[0]["after"]["gpu:0"] == streamed[0]["bytes"] <= total


def test_a_cached_rerun_lists_its_cached_nodes(server, api):
    prompt = api.load_prompt(server, MOVE)
    prompt_id = server.queue(prompt)
    server.wait(prompt_id)
    profile = server.get(f"/device_control/profile?prompt_id={prompt_id}")
    status = {node["node"]: node["status"] for node in profile["nodes"]}
    assert status["1"] == "cached" and status["5"] == "cached"  # the loader and the text encoding
    assert status["2"] == "cached"  # a VRAM Report wired after a node is cached with it


def test_a_failing_run_still_has_its_profile_and_the_failing_node_is_marked(server, api):
    prompt = api.load_prompt(server, MOVE)
    prompt["3"] = {
        "class_type": "DeviceControl_SplitModel",
        "inputs": {"model": ["1", 0], "allocation": "gpu:0=1MB", "mode": "pipeline"},
    }
    prompt_id, pushed = run_coroutine(_run_and_listen(server, prompt))
    with pytest.raises(ComfyError, match="short"):
        server.wait(prompt_id)
    profile = server.get(f"/device_control/profile?prompt_id={prompt_id}")
    assert pushed and pushed[0]["status"] == "error" == profile["status"]
    assert {node["node"]: node["status"] for node in profile["nodes"]}["3"] == "failed"


@pytest.mark.parametrize(
    ("query", "status", "message"),
    [
        ("?prompt_id=no-such-prompt", 404, "No profile of prompt 'no-such-prompt': profiles are kept for the last"),
        ("?prompt_id=%3Cscript%3E", 400, "prompt_id must be a prompt's id"),
        ("?prompt=1", 400, "unknown or repeated query parameters ['prompt']"),
        ("?prompt_id=a&prompt_id=b", 400, "unknown or repeated query parameters"),
        ("?format=xml", 400, "format 'xml' is not json or markdown"),
    ],
)
def test_bad_queries_get_clear_answers_and_the_server_keeps_serving(server, query, status, message):
    answer = status_of(server, f"/device_control/profile{query}")
    assert answer[0] == status and message in answer[1]["error"]
    assert server.get("/device_control/snapshot")["queue"]["running"] == 0
