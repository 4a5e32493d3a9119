"""How a forwarded request ends: exactly one usage record, and the router back at zero.

Every way a request can end is driven here through a real gateway over loopback: success,
a replica failing before and after its first byte, the client leaving before and after the
first byte (in both `on_client_gone` modes), an upstream timeout, and cancellation by a
shutdown. After each, the ledger holds one record for the request, with the status and
usage the ending implies, and every replica's in-flight count and prefill backlog is 0;
and no ending left its exception showing to the other tasks (ExceptionWatch).
The failing replicas are scripted raw sockets, since no real server fails on cue.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest
from tests.gateway.stack import MODEL, long_prompt, new_state_dir
from tests.support.exceptions import ExceptionWatch
from tests.support.http import async_client
from tests.support.http11 import responses
from tests.support.waiting import eventually

from saltgate.config import GatewayConfig, ReplicaConfig
from saltgate.serving.run import RunningGateway, start_gateway
from saltgate.sim.run import RunningSim, SimConfig, start_sim
from saltgate.store.ledger import UsageLedger, UsageRecord

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
FIRST_EVENT = b'data: {"choices":[{"index":0,"text":"hi"}]}\n\n'


class ScriptedReplica:
    """Answers probes like a healthy replica; fails generation requests as `mode` says:
    "reset" (close before any response), "break" (one event, then close), "hang" (never
    answer) or "stall" (one event, then nothing)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.requests = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{self.port}"

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                if head.startswith(b"GET"):
                    body = b'{"object":"list","data":[{"id":"%s"}]}' % MODEL.encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body))
                    writer.write(body)
                    continue
                self.requests += 1
                if self.mode in ("break", "stall"):
                    writer.write(SSE_HEAD + b"%x\r\n%s\r\n" % (len(FIRST_EVENT), FIRST_EVENT))
                    await writer.drain()
                if self.mode in ("hang", "stall"):
                    await asyncio.sleep(3600)
                writer.transport.abort()
                return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


@dataclass
class Gateway:
    running: RunningGateway
    key: str
    state: Path

    def client(self) -> httpx.AsyncClient:
        return async_client(
            base_url=self.running.url, headers={"authorization": f"Bearer {self.key}"}, timeout=30
        )

    def records(self) -> list[sqlite3.Row]:
        conn = sqlite3.connect(self.state / "saltgate.db")
        conn.row_factory = sqlite3.Row
        try:
            return list(conn.execute("SELECT * FROM usage ORDER BY rowid"))
        finally:
            conn.close()

    def load(self) -> list[tuple[int, float]]:
        """(in flight, prefill backlog) of every replica the router knows."""
        return [(s.inflight, s.prefill) for s in self.running.gateway.replicas.router.states]

    async def settled(self, records: int = 1) -> list[sqlite3.Row]:
        """Wait until ``records`` records exist and the router is back at zero; both must
        hold, and stay: a second record or a leaked count fails the test."""
        await eventually(
            lambda: (
                len(self.records()) >= records and all(load == (0, 0.0) for load in self.load())
            ),
            what=f"{records} record(s) and the router at zero",
        )
        await asyncio.sleep(0.05)  # and nothing more arrives
        rows = self.records()
        assert len(rows) == records, [dict(r) for r in rows]
        assert all(load == (0, 0.0) for load in self.load()), self.load()
        return rows


@asynccontextmanager
async def gateway(
    tmp: Path, urls: list[str], *, on_client_gone: str = "finish", timeout: float = 600.0
) -> AsyncIterator[Gateway]:
    state = tmp / "state"
    key = new_state_dir(state, ("alice",))["alice"]
    config = GatewayConfig(
        replicas=tuple(ReplicaConfig(u) for u in urls),
        state_dir=state,
        master_key_file=state / "master.key",
        port=0,
        admin_port=None,
        upstream_timeout_s=timeout,
        on_client_gone=on_client_gone,
    )
    watch = ExceptionWatch()
    running = await start_gateway(config)
    try:
        yield Gateway(running, key, state)
    finally:
        await running.close()
        watch.stop()
    watch.check()


@asynccontextmanager
async def sim(**kw: float) -> AsyncIterator[RunningSim]:
    running = await start_sim(SimConfig(port=0, **kw))  # type: ignore[arg-type]
    try:
        yield running
    finally:
        await running.close()


def body(*, stream: bool, max_tokens: int = 8, prompt: str = "hello there") -> dict[str, object]:
    doc: dict[str, object] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    if stream:
        doc["stream"] = True
    return doc


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_answered_request_is_metered_once_with_the_replicas_usage(
    tmp_path: Path, stream: bool
) -> None:
    async def main() -> None:
        async with sim() as s, gateway(tmp_path, [s.url]) as g, g.client() as client:
            resp = await client.post("/v1/completions", json=body(stream=stream))
            assert resp.status_code == 200
            [row] = await g.settled()
            assert (row["status"], row["completion_tokens"]) == (200, 8)
            assert row["prompt_tokens"] > 0

    asyncio.run(main())


def test_a_replica_failing_before_the_first_byte_moves_on_or_ends_in_503(tmp_path: Path) -> None:
    async def main() -> None:
        bad = ScriptedReplica("reset")
        url = await bad.start()
        async with gateway(tmp_path, [url]) as g, g.client() as client:
            resp = await client.post("/v1/completions", json=body(stream=False))
            assert resp.status_code == 503
            [row] = await g.settled()
            assert (row["status"], row["prompt_tokens"]) == (503, 0)
            assert bad.requests >= 1
        await bad.close()

    asyncio.run(main())


def test_a_replica_failing_after_the_first_byte_ends_the_stream_with_an_error(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        bad = ScriptedReplica("break")
        url = await bad.start()
        async with gateway(tmp_path, [url]) as g, g.client() as client:
            resp = await client.post("/v1/completions", json=body(stream=True))
            assert resp.status_code == 200
            assert b"hi" in resp.content and b"failed during the stream" in resp.content
            [row] = await g.settled()
            assert row["status"] == 502
        await bad.close()

    asyncio.run(main())


@pytest.mark.parametrize(("mode", "stalls"), [("hang", False), ("stall", True)])
def test_an_upstream_timeout_ends_the_exchange(tmp_path: Path, mode: str, stalls: bool) -> None:
    async def main() -> None:
        slow = ScriptedReplica(mode)
        url = await slow.start()
        async with gateway(tmp_path, [url], timeout=0.3) as g, g.client() as client:
            resp = await client.post("/v1/completions", json=body(stream=True))
            if stalls:  # the stream began: it ends with an error event
                assert resp.status_code == 200 and b"failed during the stream" in resp.content
            else:
                assert resp.status_code == 503
            [row] = await g.settled()
            assert row["status"] == (502 if stalls else 503)
        await slow.close()

    asyncio.run(main())


async def leave_after(client: httpx.AsyncClient, *, stream: bool, first_byte: bool) -> None:
    """Send a long request and hang up: before any response, or after the first event."""
    doc = body(stream=stream, max_tokens=200, prompt=long_prompt("gone", 2000))
    if not first_byte:
        with pytest.raises(httpx.ReadTimeout):
            # Only the read times out: a connect slowed by a loaded machine is no leaving.
            await client.post("/v1/completions", json=doc, timeout=httpx.Timeout(10, read=0.05))
        return
    async with client.stream("POST", "/v1/completions", json=doc) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                break


@pytest.mark.parametrize(
    ("stream", "first_byte", "status"),
    [(False, False, 200), (True, False, 499), (True, True, 499)],
    ids=["whole-before", "stream-before", "stream-after"],
)
def test_a_client_leaving_is_metered_with_the_replicas_usage(
    tmp_path: Path, stream: bool, first_byte: bool, status: int
) -> None:
    """on_client_gone = "finish" (the default): the replica finishes, and its own count of
    the prompt and completion is recorded, even when the client left before a single byte
    came back (the unmetered case the adversarial run found). Under 499 when the gateway
    saw it leave: a stream's next write fails. A client's FIN alone may be a half-close
    (the gateway then still answers, see below), and a whole answer is recorded before
    its first byte is written: one that left before it is recorded 200."""

    async def main() -> None:
        async with (
            sim(prefill_ms_per_1k_tokens=100.0, decode_ms_per_token=1.0) as s,
            gateway(tmp_path, [s.url]) as g,
            g.client() as client,
        ):
            await leave_after(client, stream=stream, first_byte=first_byte)
            [row] = await g.settled()
            assert row["status"] == status
            assert row["prompt_tokens"] > 2000 and row["completion_tokens"] == 200
            assert s.server.engine.num_running == 0

    asyncio.run(main())


@pytest.mark.parametrize(
    ("stream", "first_byte"),
    [(False, False), (True, True)],
    ids=["whole-before", "stream-after"],
)
def test_with_abort_a_client_leaving_stops_the_replica_and_is_recorded(
    tmp_path: Path, stream: bool, first_byte: bool
) -> None:
    async def main() -> None:
        async with (
            sim(prefill_ms_per_1k_tokens=100.0, decode_ms_per_token=20.0) as s,
            gateway(tmp_path, [s.url], on_client_gone="abort") as g,
            g.client() as client,
        ):
            await leave_after(client, stream=stream, first_byte=first_byte)
            [row] = await g.settled()
            assert row["status"] == 499
            assert row["completion_tokens"] < 200  # stopped, not finished
            await eventually(lambda: s.server.engine.num_running == 0, what="the replica stopped")

    asyncio.run(main())


def test_a_shutdown_ends_exchanges_in_progress_with_one_record(tmp_path: Path) -> None:
    async def main() -> None:
        async with sim(decode_ms_per_token=20.0) as s:
            state = tmp_path
            async with gateway(state, [s.url]) as g, g.client() as client:
                doc = body(stream=True, max_tokens=500)
                async with client.stream("POST", "/v1/completions", json=doc) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            break
                    await asyncio.wait_for(g.running.server.close(grace=0.1), 5)
                assert all(load == (0, 0.0) for load in g.load()), g.load()
                [row] = g.records()
                assert row["status"] in (499, 503)

    asyncio.run(main())


def test_a_body_nested_past_the_limit_is_a_400_not_a_500(tmp_path: Path) -> None:
    async def main() -> None:
        async with sim() as s, gateway(tmp_path, [s.url]) as g, g.client() as client:
            for depth, status in ((252, 200), (253, 200), (254, 400), (600, 400), (1100, 400)):
                raw = (
                    b'{"model":"%s","prompt":"hi","max_tokens":1,"metadata":' % MODEL.encode()
                    + b"[" * depth
                    + b"1"
                    + b"]" * depth
                    + b"}"
                )
                resp = await client.post(
                    "/v1/completions", content=raw, headers={"content-type": "application/json"}
                )
                assert resp.status_code == status, (depth, resp.text)
                if status == 400:
                    assert resp.json()["error"]["code"] == "json_too_deep"

    asyncio.run(main())


def test_a_key_in_a_chunked_trailer_does_not_authenticate(tmp_path: Path) -> None:
    async def main() -> None:
        async with sim() as s, gateway(tmp_path, [s.url]) as g:
            reader, writer = await asyncio.open_connection("127.0.0.1", g.running.port)
            payload = orjson.dumps(body(stream=False))
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
                + b"%x\r\n%s\r\n0\r\n" % (len(payload), payload)
                + b"authorization: Bearer %s\r\n\r\n" % g.key.encode()
            )
            out = await asyncio.wait_for(reader.read(-1), 5)
            writer.close()
            assert out.startswith(b"HTTP/1.1 401 "), out[:100]
            assert g.records() == []

    asyncio.run(main())


def test_endings_amid_other_requests_leave_no_exception_behind(tmp_path: Path) -> None:
    """Records commit in batches while other requests are served, so an ending waits for
    its commit: the moment a compiled handler would show its exception to everyone."""

    async def main() -> None:
        async with (
            sim(prefill_ms_per_1k_tokens=100.0, decode_ms_per_token=2.0) as s,
            gateway(tmp_path, [s.url], on_client_gone="abort") as g,
            g.client() as client,
        ):
            doc = body(stream=True, max_tokens=100)
            await asyncio.gather(
                *(client.post("/v1/completions", json=doc) for _ in range(6)),
                *(leave_after(client, stream=k % 2 == 0, first_byte=k % 2 == 0) for k in range(6)),
            )
            rows = await g.settled(12)
            assert sorted(r["status"] for r in rows) == [200] * 6 + [499] * 6

    asyncio.run(main())


FINS = ("with", "later", "reading", "answered")


class SlowCommits:
    """A ledger whose commits take `delay_s`, as a loaded PostgreSQL's do: a stream's
    closing `data: [DONE]` waits for its record that long after the last event."""

    def __init__(self, ledger: UsageLedger, delay_s: float) -> None:
        self.ledger = ledger
        self.delay_s = delay_s

    async def record(self, rec: UsageRecord) -> None:
        await asyncio.sleep(self.delay_s)
        await self.ledger.record(rec)

    async def aclose(self) -> None:
        await self.ledger.aclose()


async def half_closed_chat(
    port: int, key: str, doc: dict[str, object], fin: str, pad: bool
) -> bytes:
    """POST a chat completion on a raw socket (`Content-Length:  N ` when ``pad``), shut
    down the sending side ("with" the request, "later" while it is served, "reading" once
    the answer began, or "answered" once its last event came) and read to the close."""
    payload = orjson.dumps(doc)
    length = b"  %d " % len(payload) if pad else b"%d" % len(payload)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n"
        b"content-type: application/json\r\nContent-Length:%s\r\n\r\n%s"
        % (key.encode(), length, payload)
    )
    first = b""
    if fin == "later":
        await asyncio.sleep(0.002)
    elif fin == "reading":
        first = await asyncio.wait_for(reader.read(1), 10)
    elif fin == "answered":  # a stream's `data: [DONE]` still waits for the usage record
        first = await asyncio.wait_for(reader.readuntil(b'"finish_reason":"length"'), 10)
    writer.write_eof()
    out = first + await asyncio.wait_for(reader.read(-1), 10)
    writer.close()
    return out


def test_a_client_that_half_closes_after_its_request_gets_the_whole_answer(
    tmp_path: Path,
) -> None:
    """Issue 19: a streamed chat answer to a client that shut down its sending side after
    the request (`Content-Length:  216 `, then FIN) was cut, since the edge took the FIN
    for the client leaving. RFC 9112, section 9.6: it is not. Every answer arrives whole
    (each event through `data: [DONE]` and the closing zero chunk; a whole answer in full)
    and is recorded as served: the FIN before, during or after the answer (the last
    event in, `data: [DONE]` still waiting for the record: the cut the issue saw),
    streamed or not, padded length or not, 1 to 16 tokens after a short or a long prefill."""

    async def main() -> None:
        async with (
            sim(prefill_ms_per_1k_tokens=20.0, decode_ms_per_token=1.0) as s,
            gateway(tmp_path, [s.url]) as g,
        ):
            meter = g.running.gateway.meter
            meter.ledger = SlowCommits(meter.ledger, 0.005)
            served = []
            for i in range(288):  # each of the 96 cases three times
                fin, stream, pad = FINS[i % 4], i // 4 % 2 == 1, i // 8 % 2 == 1
                tokens, words = (1, 4, 16)[i // 16 % 3], (5, 405)[i // 48 % 2]
                doc = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": long_prompt(str(i), words)}],
                    "max_tokens": tokens,
                    "stream": stream,
                }
                out = await half_closed_chat(g.running.port, g.key, doc, fin, pad)
                case = (i, fin, stream, pad, tokens, out[-300:])
                [(status, answer, _)] = responses(out, ["POST"])
                assert status == 200, case
                if stream:
                    *events, done, end = answer.split(b"\n\n")
                    assert (done, end) == (b"data: [DONE]", b""), case
                    assert out.endswith(b"\r\n0\r\n\r\n"), case
                    last = orjson.loads(events[-1].removeprefix(b"data: "))
                    assert last["choices"][0]["finish_reason"] == "length", case
                else:
                    assert orjson.loads(answer)["usage"]["completion_tokens"] == tokens, case
                served.append(tokens)
            rows = await g.settled(len(served))
            assert sorted((r["status"], r["completion_tokens"]) for r in rows) == sorted(
                (200, tokens) for tokens in served
            )

    asyncio.run(main())
