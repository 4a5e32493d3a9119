"""`saltgate sim` over real HTTP on loopback, with a real ZMQ subscriber for its KV events."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncGenerator
from functools import partial
from typing import Any

import httpx
import orjson
import pytest
import zmq
from tests.support import completions
from tests.support.completions import SIM_MODEL as MODEL
from tests.support.completions import cached
from tests.support.sim import run, sim

from saltgate.audit.deployment import parse_counter
from saltgate.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from saltgate.sim import block_hashes, event_hash
from saltgate.sim.engine import Generation
from saltgate.sim.shapes import CompletionShape
from saltgate.sim.tokenizer import tokenize

JSON_TYPE = {"content-type": "application/json"}


complete = partial(completions.complete, max_tokens=1)


def test_same_salt_hits_other_or_no_salt_misses() -> None:
    async def main() -> None:
        async with sim(block_size=16) as (_, client):
            prompt = list(range(100, 200))  # 100 tokens: 6 full blocks
            assert cached(await complete(client, prompt, cache_salt="A")) == 0
            assert cached(await complete(client, prompt, cache_salt="A")) == 96
            assert cached(await complete(client, prompt, cache_salt="B")) == 0
            assert cached(await complete(client, prompt)) == 0
            assert cached(await complete(client, prompt)) == 96  # control: unsalted hits too
            exact = list(range(100, 196))  # 96 tokens: a fully cached prompt recomputes a block
            assert cached(await complete(client, exact, cache_salt="A")) == 80

    run(main)


def test_text_and_chat_prompts_count_real_tokens() -> None:
    async def main() -> None:
        async with sim() as (_, client):
            text = "The quick brown fox jumps over the lazy dog. " * 20
            doc = await complete(client, text, max_tokens=5)
            assert doc["usage"]["prompt_tokens"] == len(tokenize(text))
            assert doc["usage"]["completion_tokens"] == 5
            assert len(tokenize(doc["choices"][0]["text"])) == 5
            body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
            resp = await client.post("/v1/chat/completions", json=body)
            chat = resp.json()
            assert chat["object"] == "chat.completion"
            assert chat["usage"]["prompt_tokens"] > len(tokenize(text))  # template tokens
            assert chat["choices"][0]["message"]["role"] == "assistant"

    run(main)


async def stream_events(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[str]:
    async with client.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        return [line[6:] async for line in resp.aiter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streaming_usage_only_when_asked(path: str) -> None:
    async def main() -> None:
        async with sim() as (_, client):
            key = "messages" if "chat" in path else "prompt"
            value: object = [{"role": "user", "content": "hi"}] if "chat" in path else "hi"
            body: dict[str, Any] = {"model": MODEL, key: value, "max_tokens": 4, "stream": True}
            plain = await stream_events(client, path, body)
            assert plain[-1] == "[DONE]"
            assert all('"usage":{' not in e for e in plain)
            body["stream_options"] = {"include_usage": True}
            events = await stream_events(client, path, body)
            usage_chunk = orjson.loads(events[-2])
            assert usage_chunk["choices"] == []
            assert usage_chunk["usage"]["completion_tokens"] == 4
            # vLLM's stream usage: set fields only; chat adds what the prefill cached
            details = {"cached_tokens": 0}
            if "chat" in path:
                details["created_cache_tokens"] = 0  # a short prompt fills no block
            assert usage_chunk["usage"]["prompt_tokens_details"] == details
            finishing = orjson.loads(events[-3])["choices"][0]
            assert finishing["finish_reason"] == "length"  # on the last token's chunk

    run(main)


def test_cache_hit_shows_in_time_to_first_token() -> None:
    async def ttft(client: httpx.AsyncClient, prompt: list[int], salt: str) -> float:
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 2,
            "stream": True,
            "cache_salt": salt,
        }
        start = time.perf_counter()
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    return time.perf_counter() - start
        raise AssertionError("no token")

    async def main() -> None:
        async with sim(prefill_ms_per_1k_tokens=20, block_size=16) as (_, client):
            misses, hits = [], []
            for i in range(5):
                prompt = [1000 + i * 7 + j for j in range(2048)]  # ~41 ms to prefill cold
                misses.append(await ttft(client, prompt, "s"))
                hits.append(await ttft(client, prompt, "s"))
            assert statistics.median(misses) > statistics.median(hits) + 0.02

    run(main)


def test_eviction_under_a_small_pool_publishes_vllm_events() -> None:
    async def main() -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        port = sub.bind_to_random_port("tcp://127.0.0.1")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        endpoint = f"tcp://127.0.0.1:{port}"  # an address without '*': the replica connects
        async with sim(
            block_size=16, num_blocks=9, kv_events_endpoint=endpoint, kv_events_topic="kv@sim"
        ) as (_, client):
            # ZMQ's slow joiner: publish AllBlocksCleared until the subscriber sees one
            for _ in range(100):
                assert (await client.post("/reset_prefix_cache")).status_code == 200
                if sub.poll(50):
                    while sub.poll(100):  # drain every probe still in flight
                        sub.recv_multipart()
                    break
            first = list(range(10, 74))  # 4 blocks
            await complete(client, first, cache_salt="tenantA", max_tokens=1)
            await complete(client, list(range(500, 564)), max_tokens=1)
            await complete(client, list(range(900, 964)), max_tokens=1)  # forces evictions
            assert (await client.post("/reset_prefix_cache")).status_code == 200
            frames = []
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                if sub.poll(100):
                    frames.append(sub.recv_multipart())
                    continue
                if any(
                    isinstance(e, AllBlocksCleared)
                    for f in frames
                    for e in decode_batch(f[2]).events
                ):
                    break
        sub.close(0)
        assert frames and all(f[0] == b"kv@sim" for f in frames)
        seqs = [int.from_bytes(f[1], "big") for f in frames]
        assert seqs == list(range(seqs[0], seqs[0] + len(frames)))
        events = [e for f in frames for e in decode_batch(f[2]).events]
        stored = [e for e in events if isinstance(e, BlockStored)]
        removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        expected = [event_hash(d) for d in block_hashes(first, 16, cache_salt="tenantA")]
        first_event = stored[0]
        assert list(first_event.block_hashes) == expected
        assert first_event.extra_keys is not None
        assert first_event.extra_keys[0] == ("tenantA",)
        assert list(first_event.token_ids) == first
        assert set(expected) & set(removed)  # the oldest blocks were evicted (LRU)
        assert isinstance(events[-1], AllBlocksCleared)

    run(main)


BAD: list[tuple[str, bytes, int, str]] = [
    ("/v1/completions", b"{nope", 400, "'json_invalid', 'loc': 'body.1'"),
    ("/v1/completions", b"[1]", 400, "valid dictionary or object"),
    ("/v1/completions", b'{"model":"other","prompt":"x"}', 404, "Valid aliases: sim-model."),
    (
        "/v1/completions",
        b'{"model":"sim-model","prompt":"x","max_tokens":"five"}',
        400,
        "'int_parsing', 'loc': 'body.max_tokens'",
    ),
    ("/v1/completions", b'{"model":"sim-model","prompt":5}', 400, "4 validation errors"),
    ("/v1/completions", b'{"model":"sim-model","prompt":[99999999]}', 400, "out of vocabulary"),
    (
        "/v1/completions",
        b'{"model":"sim-model","prompt":"x","max_tokens":99999}',
        400,
        "cannot be greater than max_model_len=4096",
    ),
    (
        "/v1/chat/completions",
        b'{"model":"sim-model","messages":[{"role":"x","content":"a"}]}',
        400,
        "role",
    ),
    (
        "/v1/completions",
        b'{"model":"sim-model","prompt":"x","stream_options":{"include_usage":true}}',
        400,
        "stream=True",
    ),
]


def error_message(resp: httpx.Response) -> str:
    error = resp.json()["error"]
    assert error["code"] == resp.status_code
    return str(error["message"])


def test_bad_input_gets_vllm_shaped_errors_and_the_server_keeps_serving() -> None:
    async def main() -> None:
        async with sim(max_model_len=4096, max_body_bytes=10_000) as (_, client):
            for path, body, status, needle in BAD:
                resp = await client.post(path, content=body, headers=JSON_TYPE)
                assert resp.status_code == status, (body, resp.text)
                assert needle in error_message(resp), resp.text
            unknown = await client.post("/v1/nothing", content=b"{}", headers=JSON_TYPE)
            assert (unknown.status_code, unknown.json()) == (404, {"detail": "Not Found"})
            wrong_method = await client.get("/v1/completions")
            assert wrong_method.json() == {"detail": "Method Not Allowed"}
            no_type = await client.post("/v1/completions", content=b'{"prompt":"x"}')
            assert "Only 'application/json' is allowed" in error_message(no_type)
            resp = await client.post("/v1/completions", content=b"x" * 20_000, headers=JSON_TYPE)
            assert resp.status_code == 413
            assert cached(await complete(client, "still fine")) == 0

    run(main)


SALT_MESSAGE = (
    "Parameter 'cache_salt' must be at most 128 characters and must not contain "
    "'@', '/', '\\\\', or NUL. (parameter=cache_salt)"
)


EMPTY_SALT_MESSAGE = (
    "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)"
)


@pytest.mark.parametrize(
    ("salt", "message"),
    [
        ("", EMPTY_SALT_MESSAGE),
        (5, EMPTY_SALT_MESSAGE),
        ("a" * 129, SALT_MESSAGE),
        ("a@b", SALT_MESSAGE),
        ("a/b", SALT_MESSAGE),
        ("a\\b", SALT_MESSAGE),
        ("a\x00b", SALT_MESSAGE),
    ],
)
def test_cache_salt_validation_matches_vllm(salt: object, message: str) -> None:
    async def main() -> None:
        async with sim() as (_, client):
            resp = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "x", "cache_salt": salt}
            )
            assert resp.status_code == 400
            assert resp.json()["error"] == {
                "message": message,
                "type": "BadRequestError",
                "param": "cache_salt",
                "code": 400,
            }

    run(main)


def test_accepted_salts_match_vllm() -> None:
    async def main() -> None:
        async with sim() as (_, client):
            for salt in ("a" * 128, "ünïcødé-租户"):
                await complete(client, "x", cache_salt=salt)

    run(main)


def test_api_key_guards_v1_like_vllm() -> None:
    async def main() -> None:
        async with sim(api_key="backend-secret") as (_, client):
            body = {"model": MODEL, "prompt": "x"}
            assert (await client.post("/v1/completions", json=body)).status_code == 401
            bad = {"authorization": "Bearer nope"}
            assert (await client.post("/v1/completions", json=body, headers=bad)).status_code == 401
            assert (await client.get("/v1/models")).status_code == 401
            assert (await client.get("/health")).status_code == 200
            good = {"authorization": "Bearer backend-secret"}
            resp = await client.post("/v1/completions", json=body, headers=good)
            assert resp.status_code == 200

    run(main)


def test_metrics_use_vllm_names() -> None:
    async def main() -> None:
        async with sim(hash_algo="sha256_cbor", block_size=16) as (_, client):
            prompt = list(range(64))
            await complete(client, prompt)
            await complete(client, prompt)
            text = (await client.get("/metrics")).text
            values = {
                line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line and not line.startswith("#")
            }
            assert values["vllm:prefix_cache_queries_total"] == 128
            assert values["vllm:prefix_cache_hits_total"] == 48
            assert values["vllm:num_requests_running"] == 0
            assert values["vllm:num_requests_waiting"] == 0
            assert 0 <= values["vllm:kv_cache_usage_perc"] <= 1
            assert 'prefix_caching_hash_algo="sha256_cbor"' in text

    run(main)


def test_queue_waits_at_the_concurrency_limit() -> None:
    async def main() -> None:
        async with sim(max_concurrency=1, decode_ms_per_token=20) as (running, client):
            body = {"model": MODEL, "prompt": "x", "max_tokens": 10}
            tasks = [
                asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(3)
            ]
            engine = running.server.engine
            # Wait for all three to arrive and the first to start (a fixed 50 ms sleep
            # flaked on a busy machine); a request counts as waiting until its first
            # step, as in vLLM, so all three may show waiting for an instant.
            most_running = 0
            for _ in range(200):
                most_running = max(most_running, engine.num_running)
                if (engine.num_running, engine.num_waiting) == (1, 2):
                    break
                await asyncio.sleep(0.005)
            assert (engine.num_running, engine.num_waiting) == (1, 2)
            assert most_running <= 1
            start = time.perf_counter()
            await asyncio.gather(*tasks)
            assert time.perf_counter() - start > 0.3  # three requests of ~0.18 s, one at a time

    run(main)


def test_a_chat_streams_role_chunk_comes_with_its_first_token() -> None:
    """As in vLLM: nothing is streamed before the prefill produced the first token (a
    router may read the first chunk as "prefilled"); a stream without tokens still
    names the role; closing the stream (the client left) ends the engine's request."""

    async def main() -> None:
        pulled: list[str] = []
        ended: list[int] = []

        async def tokens(n: int) -> AsyncGenerator[str, None]:
            try:
                for i in range(n):
                    pulled.append(f" t{i}")
                    yield f" t{i}"
            finally:
                ended.append(n)

        shape = CompletionShape(chat=True, model=MODEL)
        stream = shape.sse(tokens(2), Generation(prompt_tokens=3), 2, include_usage=False)
        first = await anext(stream)
        assert b'"role":"assistant"' in first and pulled == [" t0"]
        assert b" t0" in await anext(stream)
        await stream.aclose()
        assert ended == [2] and pulled == [" t0"]  # closed, not drained
        empty = [c async for c in shape.sse(tokens(0), Generation(3), 2, include_usage=False)]
        assert b'"role":"assistant"' in empty[0]
        assert b'"finish_reason":"length"' in empty[1]  # cut short: still says how it ended

    run(main)


def test_vllms_flags_turn_off_cached_token_details_and_prefix_caching() -> None:
    """`--no-enable-prompt-tokens-details`: vLLM's null details (absent from a stream's
    usage); `--no-enable-prefix-caching`: a repeat finds nothing, no block is stored."""

    async def main() -> None:
        prompt = list(range(100, 200))
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 40}]}
        streamed = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True}
        streamed["stream_options"] = {"include_usage": True}
        async with sim(block_size=16, enable_prompt_tokens_details=False) as (_, client):
            for _ in range(2):  # the repeat hits, and still says nothing
                doc = await complete(client, prompt)
                assert doc["usage"]["prompt_tokens_details"] is None
                assert doc["usage"]["prompt_tokens"] == 100
            resp = await client.post("/v1/chat/completions", json=chat)
            assert resp.json()["usage"]["prompt_tokens_details"] is None
            usage = orjson.loads((await stream_events(client, "/v1/completions", streamed))[-2])
            assert "prompt_tokens_details" not in usage["usage"]
            hits = parse_counter(
                (await client.get("/metrics")).text, "vllm:prefix_cache_hits_total"
            )
            assert hits == 2 * 96  # the repeats did hit: it is only unsaid
        async with sim(block_size=16, enable_prefix_caching=False) as (running, client):
            assert cached(await complete(client, prompt)) == 0
            assert cached(await complete(client, prompt)) == 0
            assert running.server.engine.pool.num_cached_blocks == 0
            assert 'enable_prefix_caching="False"' in (await client.get("/metrics")).text
        async with sim(block_size=16) as (_, client):  # the control: both on by default
            await complete(client, prompt)
            assert cached(await complete(client, prompt)) == 96
            assert 'enable_prefix_caching="True"' in (await client.get("/metrics")).text

    run(main)
