"""SIGTERM drains a real `saltgate serve` (one process, and two workers): what finishes
within `[gateway] drain_grace_s` finishes; a stream still running then ends with an error
event in its route's shape and is recorded with the tokens it delivered, never 0.
During the grace, the connections already open still answer: /ready with 503
"draining" while a stream goes on, any other request with the route's retryable 503.

The control: before the drain cut answers itself, the grace's end cancelled them: the
stream stopped with neither an error event nor [DONE] and was recorded 503 with 0 tokens
(issue 43); `test_a_stream_cut_at_the_grace_ends_in_shape_and_is_billed` fails that way
when `RunningGateway.close` passes no `cut`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from tests.gateway.stack import MODEL, run
from tests.support.gateways import GatewayProcess, write_gateway_config
from tests.support.http import async_client
from tests.support.waiting import eventually

from saltgate.config import create_master_key
from saltgate.sim.run import SimConfig, start_sim
from saltgate.store.backends import open_database
from saltgate.store.settings import StoreSettings
from saltgate.store.tenants import TenantStore

GRACE_S = 1.5
Events = list[tuple[str | None, Any]]  # (event name, data: a JSON document or "[DONE]")


def usage_rows(store: StoreSettings) -> dict[str, tuple[int, int, int]]:
    """request id -> (status, prompt tokens, completion tokens)."""
    db = open_database(store, create=False)
    try:
        rows = db.query("SELECT request_id, status, prompt_tokens, completion_tokens FROM usage")
        return {str(r[0]): (int(r[1]), int(r[2]), int(r[3])) for r in rows}
    finally:
        db.close()


async def refused(url: str) -> bool:
    """A new connection to the gateway's port is refused (its listener closed)."""
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:
        return False  # queued as the listener closed: the next one tells
    writer.close()
    return False


@asynccontextmanager
async def draining_gateway(
    tmp_path: Path, grace_s: float, workers: int = 1
) -> AsyncIterator[tuple[GatewayProcess, dict[str, str]]]:
    """`saltgate serve` with `drain_grace_s = grace_s` in front of a simulated replica at
    25 ms a token, its store (in tmp_path/state) holding one tenant; the gateway and the
    headers of that tenant's key."""
    store = StoreSettings.in_state_dir(tmp_path / "state")
    master = tmp_path / "master.key"
    create_master_key(master)
    with TenantStore(open_database(store)) as tenants:
        tenants.create_tenant("acme")
        _, key = tenants.create_key("acme")
    sim = await start_sim(SimConfig(port=0, decode_ms_per_token=25))
    try:
        config = write_gateway_config(
            tmp_path / "gw.toml",
            state_dir=tmp_path / "state",
            master_key_file=master,
            replicas=[sim.url],
            gateway_extra=f"drain_grace_s = {grace_s}\n",
        )
        gateway = await GatewayProcess.start(config, tmp_path / "gw.log", workers=workers)
        try:
            yield gateway, {"authorization": f"Bearer {key}"}
        finally:
            await gateway.stop()
    finally:
        await sim.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_stream_cut_at_the_grace_ends_in_shape_and_is_billed(
    tmp_path: Path, workers: int
) -> None:
    store = StoreSettings.in_state_dir(tmp_path / "state")

    async def main() -> None:
        async with draining_gateway(tmp_path, GRACE_S, workers) as (gateway, headers):
            async with async_client(base_url=gateway.url, headers=headers, timeout=30) as http:
                long = {  # 400 tokens: 10 s, far past the grace
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "a long answer"}],
                    "max_tokens": 400,
                    "stream": True,
                }
                short = {"model": MODEL, "prompt": "short", "max_tokens": 30, "stream": True}
                async with (
                    http.stream("POST", "/v1/chat/completions", json=long) as cut,
                    http.stream("POST", "/v1/completions", json=short) as finished,
                ):
                    assert cut.status_code == finished.status_code == 200
                    cut_lines, finished_lines = cut.aiter_lines(), finished.aiter_lines()
                    received = [await anext(cut_lines) for _ in range(10)]
                    assert (await anext(finished_lines)).startswith("data: {")
                    signalled = time.monotonic()
                    os.kill(gateway.proc.pid, signal.SIGTERM)
                    await eventually(lambda: refused(gateway.url), what="the listener closed")
                    received += [line async for line in cut_lines]
                    ended = time.monotonic() - signalled
                    rest = [line async for line in finished_lines if line]
                    cut_id = cut.headers["x-request-id"]
                    finished_id = finished.headers["x-request-id"]
            assert rest[-1] == "data: [DONE]"  # in flight at SIGTERM, done within the grace
            data = [line[6:] for line in received if line.startswith("data: ")]
            assert "[DONE]" not in data
            error = orjson.loads(data[-1])["error"]
            assert error["code"] == "gateway_stopping" and error["type"] == "service_unavailable"
            assert GRACE_S <= ended < GRACE_S + 8, ended
            assert await asyncio.wait_for(gateway.proc.wait(), 30) == 0
        rows = usage_rows(store)
        status, prompt, completion = rows[cut_id]
        content = len(data) - 2  # the role event and the error event carry no token
        assert status == 503 and prompt > 0
        assert content - 2 <= completion <= content, (completion, content)
        assert rows[finished_id][0] == 200 and rows[finished_id][2] == 30

    run(main)


def _request(route: str, max_tokens: int) -> dict[str, object]:
    if route == "/v1/responses":
        return {"model": MODEL, "input": "drain", "max_output_tokens": max_tokens, "stream": True}
    messages = [{"role": "user", "content": "drain"}]
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True}


def _events(text: str) -> Events:
    out: Events = []
    for block in text.split("\n\n"):
        name = data = None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        if data is not None:
            out.append((name, data if data == "[DONE]" else orjson.loads(data)))
    return out


def _tokens(route: str, events: Events) -> int:
    """Output tokens the client received: the simulator sends one per delta event."""
    kinds = {
        "/v1/messages": "content_block_delta",
        "/v1/responses": "response.output_text.delta",
        "/v1/chat/completions": "chat.completion.chunk",
    }
    count = 0
    for _, data in events:
        if isinstance(data, dict) and kinds[route] in (data.get("type"), data.get("object")):
            choices = data.get("choices")
            count += not choices or bool(choices[0]["delta"].get("content"))
    return count


def _cut_in_shape(route: str, events: Events) -> None:
    """The last event is the route's error event; nothing says the answer was whole."""
    name, last = events[-1]
    kinds = {data.get("type") for _, data in events if isinstance(data, dict)}
    assert all(data != "[DONE]" for _, data in events)
    if route == "/v1/messages":
        assert name == "error" and last["type"] == "error"
        assert last["error"]["type"] == "api_error" and "shutting down" in last["error"]["message"]
        assert "message_stop" not in kinds
    elif route == "/v1/responses":
        assert name == "error" and last["type"] == "error"
        assert last["code"] == "gateway_stopping" and "shutting down" in last["message"]
        assert "response.completed" not in kinds
    else:
        assert name is None and last["error"]["code"] == "gateway_stopping"


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_open_connections_read_draining_while_a_stream_runs_then_it_is_cut_in_shape(
    tmp_path: Path, route: str
) -> None:
    """A balancer's probe on a connection open before SIGTERM reads /ready 503 "draining"
    at once, while a long stream goes on (more of it arrives after); a request on that
    connection gets the route's 503; when the grace ends the stream ends with the route's
    error event and its row has the tokens the client received."""
    store = StoreSettings.in_state_dir(tmp_path / "state")

    async def main() -> None:
        one = httpx.Limits(max_connections=1)
        async with draining_gateway(tmp_path, 3.0) as (gateway, headers):
            async with (
                async_client(base_url=gateway.url, headers=headers, timeout=30) as http,
                async_client(
                    base_url=gateway.url, headers=headers, timeout=30, limits=one
                ) as probe,
            ):
                assert (await probe.get("/ready")).status_code == 200  # its connection opens
                async with http.stream("POST", route, json=_request(route, 2000)) as cut:
                    assert cut.status_code == 200
                    chunks = cut.aiter_text()
                    received = ""
                    while _tokens(route, _events(received)) < 3:
                        received += await anext(chunks)
                    os.kill(gateway.proc.pid, signal.SIGTERM)

                    async def draining() -> bool:
                        ready = await probe.get("/ready")
                        return ready.status_code == 503 and ready.json()["draining"] is True

                    await eventually(draining, what="/ready 503 draining on an open connection")
                    at_503 = _tokens(route, _events(received))
                    refused_now = await probe.post(route, json=_request(route, 5))
                    assert refused_now.status_code == 503, refused_now.text
                    error = refused_now.json()["error"]
                    if route == "/v1/messages":
                        assert refused_now.json()["type"] == "error"
                        assert error["type"] == "api_error"
                    else:
                        assert error["code"] == "gateway_stopping"
                    while _tokens(route, _events(received)) <= at_503 + 3:  # the stream goes on
                        received += await anext(chunks)
                    async for text in chunks:
                        received += text
                    cut_id = cut.headers["x-request-id"]
            events = _events(received)
            _cut_in_shape(route, events)
            assert await asyncio.wait_for(gateway.proc.wait(), 30) == 0
        status, _, completion = usage_rows(store)[cut_id]
        delivered = _tokens(route, events)
        assert status == 503 and 0 < delivered < 2000
        assert delivered - 2 <= completion <= delivered + 1, (completion, delivered)

    run(main)
