"""SIGTERM drains a real `saltgate serve` (one process, and two workers): what finishes
within `[gateway] drain_grace_s` finishes; a stream still running then ends with an error
event in its route's shape and is recorded with the tokens it delivered, never 0.

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
from pathlib import Path

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


@pytest.mark.parametrize("workers", [1, 2])
def test_a_stream_cut_at_the_grace_ends_in_shape_and_is_billed(
    tmp_path: Path, workers: int
) -> None:
    store = StoreSettings.in_state_dir(tmp_path / "state")
    master = tmp_path / "master.key"
    create_master_key(master)
    with TenantStore(open_database(store)) as tenants:
        tenants.create_tenant("acme")
        _, key = tenants.create_key("acme")

    async def main() -> None:
        sim = await start_sim(SimConfig(port=0, decode_ms_per_token=25))
        config = write_gateway_config(
            tmp_path / "gw.toml",
            state_dir=tmp_path / "state",
            master_key_file=master,
            replicas=[sim.url],
            gateway_extra=f"drain_grace_s = {GRACE_S}\n",
        )
        gateway = await GatewayProcess.start(config, tmp_path / "gw.log", workers=workers)
        headers = {"authorization": f"Bearer {key}"}
        try:
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
        finally:
            await gateway.stop()
            await sim.close()
        rows = usage_rows(store)
        status, prompt, completion = rows[cut_id]
        content = len(data) - 2  # the role event and the error event carry no token
        assert status == 503 and prompt > 0
        assert content - 2 <= completion <= content, (completion, content)
        assert rows[finished_id][0] == 200 and rows[finished_id][2] == 30

    run(main)
