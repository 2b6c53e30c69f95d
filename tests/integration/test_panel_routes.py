"""The live panel's server side in a real ComfyUI: the snapshot, the push over ComfyUI's websocket, the actions."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from tools.bench.stress import run_coroutine
from tools.runtime.server import ComfyError

REPO = Path(__file__).resolve().parents[2]
PLACED = REPO / "workflows" / "02 SD1.5 - UNet on the GPU, text encoder on the CPU.json"
MOVE = REPO / "workflows" / "01 Start here - SD1.5 moved to the GPU, then offloaded.json"
GiB = 1024**3
UNET_BYTES = int(3.2 * GiB)


def raw_post(server, path: str, data: bytes) -> tuple[int, dict]:
    """POST raw bytes; return the status and the decoded JSON answer (errors included)."""
    request = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        text = exc.read()
        try:
            return exc.code, json.loads(text or b"{}")
        except json.JSONDecodeError:
            return exc.code, {"error": text.decode(errors="replace")}


def model(snapshot: dict, component: str) -> dict | None:
    return next((m for m in snapshot["report"]["models"] if m["component"] == component), None)


def gpu(snapshot: dict) -> dict:
    return next(d for d in snapshot["report"]["devices"] if d["id"] == "gpu:0")


@pytest.fixture(scope="module")
def server(servers):
    return servers("panel-8g", SIMULATE_GPU="8GiB")


def test_the_snapshot_shows_devices_models_and_placements(server, api):
    server.run(api.load_prompt(server, PLACED))
    snapshot = server.get("/device_control/snapshot")
    assert snapshot["executing"] is None and snapshot["queue"] == {"running": 0, "pending": 0}
    assert gpu(snapshot)["total"] == 8 * GiB and gpu(snapshot)["torch_allocated"] >= UNET_BYTES
    host = snapshot["report"]["host"]
    assert 0 < host["process_rss"] <= host["total"]
    unet = model(snapshot, "MODEL")
    assert unet["resident"] == {"gpu:0": unet["total_bytes"]} and unet["total_bytes"] >= UNET_BYTES
    assert unet["key"] and unet["managed_by"] == "Device Control" and unet["budget"] == "all"
    assert model(snapshot, "CLIP")["resident"].get("cpu", 0) > 0
    assert snapshot["report"]["mode"]["vram_state"] == "DISABLED"
    assert "--cpu" in snapshot["flags"]
    assert set(snapshot["pinned"]) == {"comfyui", "device_control", "cap"}
    assert snapshot["push"]["listening"] is False  # nobody subscribed: no pushes


def test_offloading_one_model_frees_its_vram_and_the_next_run_is_unchanged(server, api):
    prompt = api.load_prompt(server, PLACED)
    server.forget_outputs()  # answered from the cache, an unchanged prompt would load nothing to offload
    before = api.image_of(server, server.run(prompt))
    unet = model(server.get("/device_control/snapshot"), "MODEL")
    answer = server.post("/device_control/offload", {"model": unet["key"]})
    assert answer["offloaded"] == 1 and answer["freed"]["gpu:0"] == unet["total_bytes"]
    after = server.get("/device_control/snapshot")
    assert model(after, "MODEL") is None  # ComfyUI's books no longer list it
    assert gpu(after)["torch_allocated"] < 64 * 1024**2
    server.forget_outputs()  # unchanged, the prompt would be answered from the cache and load nothing
    again = server.run(prompt)  # loads it back where the workflow puts it
    assert np.array_equal(api.image_of(server, again), before)
    assert model(server.get("/device_control/snapshot"), "MODEL")["resident"]["gpu:0"] == unet["total_bytes"]


def test_offload_all_and_free_caches(server, api):
    server.forget_outputs()
    server.run(api.load_prompt(server, PLACED))
    answer = server.post("/device_control/offload", {"all": True})
    assert answer["offloaded"] >= 2 and answer["freed"]["gpu:0"] >= UNET_BYTES
    assert server.get("/device_control/snapshot")["report"]["models"] == []
    assert server.post("/device_control/free_caches", {}) == {"freed_caches": True}
    assert server.post("/device_control/offload", {"all": True}) == {"offloaded": 0, "freed": {}}


@pytest.mark.parametrize(
    ("path", "data", "status", "message"),
    [
        ("/device_control/offload", b"{not json", 400, "not JSON"),
        ("/device_control/offload", b"[1, 2]", 400, "JSON object"),
        ("/device_control/offload", b"{}", 400, '{"model": "<key from the snapshot>"}'),
        ("/device_control/offload", b'{"model": "no-such-model"}', 404, "no loaded model has the key"),
        ("/device_control/offload", b'{"model": "' + b"x" * 5000 + b'"}', 413, "larger than 4096 bytes"),
        ("/device_control/subscribe", b'{"interval": "fast"}', 400, "must be a number of seconds"),
        ("/device_control/subscribe", b'{"interval": -1}', 400, "0 (off) or a number of seconds"),
        ("/device_control/subscribe", b'{"interval": NaN}', 400, "0 (off) or a number of seconds"),
        ("/device_control/subscribe", b'{"interval": 1, "client": 7}', 400, "client must be your websocket's"),
        ("/device_control/subscribe", b'{"interval": 1}', 400, "client must be your websocket's client id"),
        ("/device_control/free_caches", b"\xff\xfe", 400, "not JSON"),
    ],
)
def test_bad_requests_are_refused_with_the_fix_and_the_server_keeps_serving(server, path, data, status, message):
    answered, body = raw_post(server, path, data)
    assert answered == status and message in body["error"]
    assert "devices" in server.get("/device_control/snapshot")["report"]


def test_reads_are_get_and_actions_are_post_only(server):
    for path in ("/device_control/offload", "/device_control/free_caches", "/device_control/subscribe"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(server.url + path, timeout=30)
        assert refused.value.code in (404, 405)  # ComfyUI's static routes answer 404 before aiohttp's 405
    status, _ = raw_post(server, "/device_control/snapshot", b"{}")
    assert status in (404, 405)


async def _listen(url: str, client: str, seconds: float) -> list[dict]:
    received = []
    async with aiohttp.ClientSession() as session, session.ws_connect(f"{url}/ws?clientId={client}") as ws:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                message = await ws.receive(timeout=left)
            except asyncio.TimeoutError:
                break
            if message.type == aiohttp.WSMsgType.TEXT:
                data = json.loads(message.data)
                if data["type"] == "device_control.vram":
                    received.append(data["data"])
    return received


def test_the_push_reaches_websocket_clients_while_subscribed_and_stops_after(server):
    client = uuid.uuid4().hex
    answer = server.post("/device_control/subscribe", {"interval": 0.2, "client": client})
    assert answer == {"interval": 0.2, "listening": True, "event": "device_control.vram"}
    pushed = run_coroutine(_listen(server.url, client, 1.5))
    assert len(pushed) >= 4
    assert all("gpu:0" in [d["id"] for d in p["report"]["devices"]] for p in pushed)
    assert pushed[-1]["time"] > pushed[0]["time"]
    # Utilisation and temperature per device, in the push: neither the CPU nor the simulated GPU can tell.
    assert all((d["utilization"], d["temperature"]) == (None, None) for d in pushed[-1]["report"]["devices"])
    server.post("/device_control/subscribe", {"interval": 0, "client": client})
    time.sleep(0.3)
    assert run_coroutine(_listen(server.url, client, 1.0)) == []
    stats = server.get("/device_control/snapshot")["push"]
    assert stats["listening"] is False and stats["pushes"] >= 4 and stats["failures"] == 0
    assert 0 < stats["cpu_share"] < 0.5


async def _pushes_while_running(server, client: str, prompt: dict) -> list[dict]:
    """Every push ``client`` gets from subscribing (once a minute) until ``prompt`` has run to its end."""
    received = []
    async with aiohttp.ClientSession() as session, session.ws_connect(f"{server.url}/ws?clientId={client}") as ws:
        await asyncio.to_thread(server.post, "/device_control/subscribe", {"interval": 60, "client": client})
        prompt_id = await asyncio.to_thread(server.queue, prompt, client)
        deadline = time.monotonic() + 300
        while (left := deadline - time.monotonic()) > 0:
            message = await ws.receive(timeout=left)
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(message.data)
            if data["type"] == "device_control.vram":
                received.append(data["data"])
            elif data["type"] == "executing" and (data["data"].get("node"), data["data"].get("prompt_id")) == (
                None,
                prompt_id,
            ):
                break  # the prompt has run to its end
    return received


def test_every_move_a_node_makes_is_pushed_at_once(server, api):
    """With a push due only once a minute, the panel still sees Move To GPU's placement and Offload To CPU's undoing
    of it, a sampler apart: each node pushes as soon as it has moved something."""
    server.forget_outputs()  # answered from the cache, an unchanged prompt would move nothing, and push nothing
    client = uuid.uuid4().hex
    try:
        pushed = run_coroutine(_pushes_while_running(server, client, api.load_prompt(server, MOVE)))
    finally:
        server.post("/device_control/subscribe", {"interval": 0, "client": client})
    on_gpu = [(model(p, "MODEL") or {}).get("resident", {}).get("gpu:0", 0) for p in pushed]
    assert len(pushed) >= 3, on_gpu  # the subscription's first push, then Move To GPU's and Offload To CPU's
    assert max(on_gpu) >= UNET_BYTES, on_gpu
    assert on_gpu[-1] == 0 and gpu(pushed[-1])["torch_allocated"] < 64 * 1024**2, on_gpu


async def _listen_all(url: str, clients: list[str], seconds: float) -> dict[str, int]:
    counts = dict.fromkeys(clients, 0)

    async def one(client: str) -> None:
        counts[client] = len(await _listen(url, client, seconds))

    await asyncio.gather(*(one(client) for client in clients))
    return counts


def test_each_client_gets_pushes_at_its_own_rate_and_others_get_none(server):
    fast, slow, silent = (uuid.uuid4().hex for _ in range(3))
    server.post("/device_control/subscribe", {"interval": 0.1, "client": fast})
    server.post("/device_control/subscribe", {"interval": 1, "client": slow})
    try:
        counts = run_coroutine(_listen_all(server.url, [fast, slow, silent], 2.0))
    finally:
        for client in (fast, slow):
            server.post("/device_control/subscribe", {"interval": 0, "client": client})
    assert counts[fast] >= 8  # about 10 a second, as it asked
    assert 1 <= counts[slow] <= 3  # the fast client does not speed up the others
    assert counts[silent] == 0  # and nobody who did not subscribe is sent anything


@pytest.fixture(scope="module")
def slow_server(servers):
    return servers("panel-slow", SIMULATE_GPU="8GiB", SIMULATE_FAULTS="slow_moves")


def test_actions_are_refused_while_a_prompt_runs_and_work_after(slow_server, api):
    prompt_id = slow_server.queue(api.load_prompt(slow_server, MOVE))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "Move To GPU: moving" not in slow_server.log_tail(30):
            time.sleep(0.05)
        snapshot = slow_server.get("/device_control/snapshot")
        assert snapshot["queue"]["running"] == 1
        assert snapshot["executing"]["prompt_id"] == prompt_id and snapshot["executing"]["node"] == "3"
        for path, body in (("/device_control/offload", {"all": True}), ("/device_control/free_caches", {})):
            with pytest.raises(ComfyError, match=r"409.*a prompt is running"):
                slow_server.post(path, body)
    finally:
        slow_server.post("/interrupt", {})
        with pytest.raises(ComfyError):
            slow_server.wait(prompt_id)
    assert slow_server.post("/device_control/offload", {"all": True})["offloaded"] >= 0
    assert slow_server.get("/device_control/snapshot")["executing"] is None


def test_an_action_never_stalls_the_server_and_prompts_queued_meanwhile_wait_for_it(slow_server, api):
    """Offloading from a slow device takes seconds; meanwhile ComfyUI still answers, and queues a prompt that
    starts only once the action is done (so no model moves under it)."""
    placed = api.load_prompt(slow_server, MOVE)
    keep = {n: placed[n] for n in ("1", "2", "3", "4")}  # load, report, Move To GPU, report: the model stays
    entry = slow_server.run(keep)
    assert api.report_json(entry, "4")["subject"]["resident"]["gpu:0"] > 0
    done: dict[str, object] = {}
    action = threading.Thread(
        target=lambda: done.update(answer=slow_server.post("/device_control/offload", {"all": True}))
    )
    action.start()
    time.sleep(0.5)
    started = time.monotonic()
    prompt_id = slow_server.queue(api.report_prompt(label="queued during the offload"))
    answered = time.monotonic() - started
    still_offloading = action.is_alive()
    action.join(timeout=120)
    report = api.report_json(slow_server.wait(prompt_id))
    assert still_offloading, "the offload ended before the prompt was queued: the test proves nothing"
    assert answered < 1.0, f"POST /prompt took {answered:.1f} s while an action ran"
    assert done["answer"]["offloaded"] >= 1
    assert next(d for d in report["devices"] if d["id"] == "gpu:0")["torch_allocated"] == 0  # ran after it
