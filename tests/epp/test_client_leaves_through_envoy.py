"""A client that leaves a stream through Envoy: Envoy resets the replica's stream (vLLM
aborts the request), so the EPP cannot read the answer to its end as the gateway does.
Its record is still there, 499, with the output it relayed (docs/epp.md, docs/billing.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import orjson
from tests.epp.test_through_envoy import MODEL, envoy_stack, ledger_rows_of
from tests.gateway.stack import long_prompt, run
from tests.support.waiting import eventually

from saltgate.sim.run import SimConfig

# Slow enough between tokens (100 ms) that the client's leaving after a few events is
# far from the end of its answer, however loaded the machine.
SLOW = SimConfig(port=0, model=MODEL, decode_ms_per_token=100.0)
READ = 5  # the content events the client reads before it leaves
MAX_TOKENS = 60


def is_token(line: str) -> bool:
    """Whether a stream line is an event with a token (the opening role delta has none)."""
    if not line.startswith("data: {"):
        return False
    return bool(orjson.loads(line[6:])["choices"][0]["delta"].get("content"))


def test_a_client_leaving_mid_stream_is_recorded_499_with_what_was_relayed(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        async with envoy_stack(tmp_path, sim=SLOW) as s, s.client("alice") as http:
            request = {
                "model": MODEL,
                "messages": [{"role": "user", "content": long_prompt("leaving")}],
                "max_tokens": MAX_TOKENS,
                "stream": True,
            }
            read = 0
            async with http.stream("POST", "/v1/chat/completions", json=request) as answer:
                assert answer.status_code == 200
                async for line in answer.aiter_lines():
                    if is_token(line):
                        read += 1
                        if read == READ:
                            break  # leaving the block closes the connection mid-stream
            await eventually(lambda: bool(ledger_rows_of(s)), what="the request is recorded")
            [row] = ledger_rows_of(s)
            assert row["status"] == 499
            # The replica's final usage never came: its output is what was relayed (an
            # event a token, as the drain counts), a few more than the client read at most.
            assert READ <= row["completion_tokens"] <= READ + 3, row["completion_tokens"]
            assert row["completion_tokens"] < MAX_TOKENS
            assert row["prompt_tokens"] > 0  # estimated from the body
            assert row["cached_tokens"] is None  # unknown, not zero

    run(body)


def test_clients_leaving_before_the_answer_do_not_take_a_replica_out(tmp_path: Path) -> None:
    """A client that gives up before a whole answer comes (Envoy resets its ext_proc stream
    before any response header) left: it is recorded 499, and the replica is not blamed.
    More such clients than the breaker's threshold (3) in a row must not take the replica
    out of rotation, or every impatient client would turn into 503s for all tenants."""

    async def body() -> None:
        async with envoy_stack(tmp_path, sim=SLOW) as s, s.client("alice") as http:
            request = {
                "model": MODEL,
                "messages": [{"role": "user", "content": long_prompt("impatient")}],
                "max_tokens": MAX_TOKENS,  # 6 s of decoding: the client leaves long before
            }
            for left in range(1, 5):
                posting = asyncio.create_task(http.post("/v1/chat/completions", json=request))
                await eventually(lambda: len(s.bodies()) >= left, what="the replica has it")
                posting.cancel()  # the client leaves: its connection to Envoy closes
                with contextlib.suppress(asyncio.CancelledError):
                    await posting
                await eventually(lambda: len(ledger_rows_of(s)) >= left, what="recorded")
            assert [row["status"] for row in ledger_rows_of(s)] == [499] * 4
            router = s.epp.gateway.replicas.router
            assert len(router.usable(MODEL, time.monotonic())) == 2  # none taken out

    run(body)
