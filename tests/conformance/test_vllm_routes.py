"""The simulator against real vLLM 0.32, route by route (issue 15; `pytest -m vllm`).

Each test sends the same requests to a real replica and to `saltgate sim` started with the
replica's settings (model "tiny", block size 32, context 2048, the same API key), and
asserts that both answer alike: the same JSON keys at every level (values differ: the
models differ), the same stream events in the same order, the same usage accounting for
the prefix cache, byte-identical error bodies, the same metric families. docs/conformance.md
has the table of what each route answers.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest
from tests.conformance.fleet import (
    BLOCK_SIZE,
    MODEL_NAME,
    Fleet,
    VllmReplica,
    events_since,
    stored,
)
from tests.gateway.stack import long_prompt
from tests.support.http import async_client
from tests.support.kv_relay import raw_stream

from saltgate.kvevents.wire import decode_batch
from saltgate.sim.run import RunningSim, SimConfig, start_sim

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CONTEXT = 2048


@asynccontextmanager
async def sim_like(fleet: Fleet, *, events: bool = False) -> AsyncIterator[RunningSim]:
    """A simulated replica configured as the real ones (no time model: shapes, not speed)."""
    config = SimConfig(
        port=0,
        model=MODEL_NAME,
        block_size=BLOCK_SIZE,
        max_model_len=CONTEXT,
        api_key=fleet.api_key,
        prefill_ms_per_1k_tokens=0,
        decode_ms_per_token=0,
        kv_events_endpoint="tcp://127.0.0.1:*" if events else None,
        kv_events_replay_endpoint="tcp://127.0.0.1:*" if events else None,
    )
    running = await start_sim(config)
    try:
        yield running
    finally:
        await running.close()


def client(url: str, api_key: str) -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {api_key}"}
    return async_client(base_url=url, headers=headers, timeout=120)


# ------------------------------------------------------------------------------ shapes


def shape(value: object) -> object:
    """A JSON value's structure: keys, list element structure, scalar kinds."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    return "number" if isinstance(value, int | float) else "str"


# Where the real model's random output may differ in kind: it may stop on EOS (then
# nothing is incomplete) or sample tokens that decode to nothing (an empty content list).
NULLABLE = frozenset({"incomplete_details"})


def differences(sim: object, real: object, path: str = "") -> list[str]:
    if isinstance(sim, dict) and isinstance(real, dict):
        out = [f"{path}.{k}: only the simulator has it" for k in sim.keys() - real.keys()]
        out += [f"{path}.{k}: only vLLM has it" for k in real.keys() - sim.keys()]
        for k in sim.keys() & real.keys():
            if k in NULLABLE and None in (sim[k], real[k]):
                continue
            out += differences(sim[k], real[k], f"{path}.{k}")
        return out
    if isinstance(sim, list) and isinstance(real, list):
        return differences(sim[0], real[0], path + "[0]") if sim and real else []
    return [] if sim == real else [f"{path}: {sim!r} (simulator) vs {real!r} (vLLM)"]


def assert_same_shape(sim: object, real: object, what: str) -> None:
    found = differences(shape(sim), shape(real))
    assert not found, f"{what}: " + "; ".join(sorted(found))


async def read_events(resp: httpx.Response) -> list[tuple[str, Any]]:
    """(kind, data) per server-sent event: the `event:` name, or for OpenAI's unnamed
    chunks role / token / last / usage / [DONE]."""
    out: list[tuple[str, Any]] = []
    async for block in _blocks(resp):
        fields = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
        data = fields.get("data", "")
        if data == "[DONE]":
            out.append(("[DONE]", data))
            continue
        doc = orjson.loads(data)
        kind = fields.get("event")
        if kind is None:
            choice = doc["choices"][0] if doc["choices"] else None
            if choice is None:
                kind = "usage"
            elif "role" in choice.get("delta", {}):
                kind = "role"
            else:
                kind = "last" if choice["finish_reason"] else "token"
        out.append((kind, doc))
    return out


async def _blocks(resp: httpx.Response) -> AsyncIterator[str]:
    buffer = ""
    async for chunk in resp.aiter_text():
        buffer += chunk
        while "\n\n" in buffer:
            block, buffer = buffer.split("\n\n", 1)
            if block.strip():
                yield block


def collapsed(kinds: list[str]) -> list[str]:
    """The event kinds with runs of one kind (the per-token deltas) counted once."""
    return [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]


# vLLM sends the events that carry an Anthropic or Responses answer's text only for text it
# has: when the tiny model's 3 tokens decode to nothing (special tokens, an unfinished UTF-8
# sequence; one /v1/messages stream in 50 runs of test_8 on 2026-12-03), a /v1/messages
# stream has no content block and a /v1/responses stream no output item (both skip empty
# content: https://github.com/vllm-project/vllm/blob/main/vllm/entrypoints/anthropic/serving.py,
# https://github.com/vllm-project/vllm/blob/main/vllm/entrypoints/openai/responses/streaming_events.py).
# The simulator's answers always have text.
TEXT_EVENTS = frozenset(
    {
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    }
)


def streams_vllm_may_send(sim_kinds: list[str]) -> list[list[str]]:
    """The event kinds vLLM may send where the simulator sent `sim_kinds`, runs collapsed.

    Besides the same: vLLM merges the deltas its HTTP layer has not taken yet
    (`RequestOutputCollector`,
    https://github.com/vllm-project/vllm/blob/main/vllm/v1/engine/output_processor.py), so
    on a busy machine all of a short completion's tokens may come in its last chunk; and an
    answer without text has none of the TEXT_EVENTS.
    """
    same = collapsed(sim_kinds)
    all_merged = [k for k in same if k != "token"]
    textless = [k for k in same if k not in TEXT_EVENTS]
    return [same, all_merged, textless]


def assert_same_stream(sim: list[tuple[str, Any]], real: list[tuple[str, Any]], what: str) -> None:
    """The same events in the same order, each shaped alike (but see streams_vllm_may_send)."""
    sim_kinds, real_kinds = [k for k, _ in sim], [k for k, _ in real]
    expected = streams_vllm_may_send(sim_kinds)
    assert collapsed(real_kinds) in expected, f"{what}: {sim_kinds} vs {real_kinds}"
    first_of = {k: d for k, d in reversed(real)}
    for kind, data in sim:
        if kind != "[DONE]" and kind in first_of:
            assert_same_shape(data, first_of[kind], f"{what} {kind}")


def test_vllm_may_merge_deltas_and_leave_out_empty_text_and_nothing_more() -> None:
    token = {"choices": [{"text": "a", "finish_reason": None}]}
    last = {"choices": [{"text": "b", "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 1}}
    sim = [("token", token), ("token", token), ("last", last), ("usage", usage), ("[DONE]", "")]
    done = [("usage", usage), ("[DONE]", "")]
    assert_same_stream(sim, [("token", token), ("last", last), *done], "unmerged")
    assert_same_stream(sim, [("last", last), *done], "merged")  # CI, Dec 3, at 3ec63e8
    with pytest.raises(AssertionError, match="vs"):
        assert_same_stream(sim, [("last", last), ("[DONE]", "")], "no usage")
    with pytest.raises(AssertionError, match="vs"):
        assert_same_stream(sim[2:], [("token", token), ("last", last), *done], "no sim deltas")
    with pytest.raises(AssertionError, match="last"):
        assert_same_stream(sim, [("last", {"choices": [{"text": "b"}]}), *done], "a last apart")

    def events(*kinds: str) -> list[tuple[str, Any]]:
        return [(kind, {"type": kind}) for kind in kinds]

    ends = ("message_delta", "message_stop")
    block = ("content_block_start", "content_block_delta", "content_block_stop")
    answer = events("message_start", *block, *ends)
    assert_same_stream(answer, events("message_start", *ends), "no text")  # Dec 3, 1 in 50
    with pytest.raises(AssertionError, match="vs"):
        assert_same_stream(answer, events("message_start", *block[::2], *ends), "half a block")
    with pytest.raises(AssertionError, match="vs"):
        assert_same_stream(events("message_start", *ends), answer, "simulated without text")


# ------------------------------------------------------------------------------ generation

RUN = secrets.token_hex(3)  # fresh prompts per run: a warm cache must not fake a result
PROMPT = long_prompt(f"routes{RUN}x", 60)


def route_body(route: str, salt: str) -> dict[str, Any]:
    base: dict[str, Any] = {"model": MODEL_NAME, "cache_salt": salt}
    if route == "/v1/completions":
        return {**base, "prompt": PROMPT, "max_tokens": 3}
    if route == "/v1/chat/completions":
        return {**base, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3}
    if route == "/v1/responses":
        return {**base, "input": PROMPT, "instructions": "Be brief.", "max_output_tokens": 3}
    return {
        **base,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
        "max_tokens": 3,
    }


def prompt_usage(route: str, usage: dict[str, Any]) -> tuple[int, int, int | None]:
    """(prompt tokens, cached, written to the cache) as each API reports them."""
    if route == "/v1/responses":
        details = usage["input_tokens_details"]
        return usage["input_tokens"], details["cached_tokens"], details["cache_write_tokens"]
    if route == "/v1/messages":
        read, written = usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]
        return usage["input_tokens"] + read + written, read, written
    details = usage["prompt_tokens_details"]
    return usage["prompt_tokens"], details["cached_tokens"], details.get("created_cache_tokens")


def stream_usage(route: str, events: list[tuple[str, Any]]) -> dict[str, Any]:
    kind, key = {
        "/v1/responses": ("response.completed", "response"),
        "/v1/messages": ("message_delta", None),
    }.get(route, ("usage", None))
    data = next(d for k, d in events if k == kind)
    usage: dict[str, Any] = (data[key] if key else data)["usage"]
    return usage


async def generation_run(url: str, api_key: str, route: str) -> dict[str, Any]:
    """One route's sequence: whole (salt A), streamed repeat (A), whole (salt B)."""
    salt_a, salt_b = f"a-{RUN}-{route[4:8]}", f"b-{RUN}-{route[4:8]}"
    stream_extra: dict[str, Any] = {"stream": True}
    if route in ("/v1/completions", "/v1/chat/completions"):
        stream_extra["stream_options"] = {"include_usage": True}
    async with client(url, api_key) as c:
        first = await c.post(route, json=route_body(route, salt_a))
        assert first.status_code == 200, first.text
        body = {**route_body(route, salt_a), **stream_extra}
        async with c.stream("POST", route, json=body) as resp:
            assert resp.status_code == 200
            content_type = resp.headers["content-type"]
            events = await read_events(resp)
        other = await c.post(route, json=route_body(route, salt_b))
        counted = None
        if route == "/v1/messages":
            count = await c.post("/v1/messages/count_tokens", json=route_body(route, salt_a))
            counted = count.json()
    return {
        "first": first.json(),
        "events": events,
        "content_type": content_type,
        "other": other.json(),
        "counted": counted,
    }


def check_accounting(route: str, run: dict[str, Any], who: str) -> None:
    """vLLM's prefix-cache accounting: only full blocks count; a repeat hits all but the
    block holding the last prompt token; what a prefill writes is its full blocks not hit;
    another salt hits nothing."""
    prompt, cached, written = prompt_usage(route, run["first"]["usage"])
    assert prompt > 2 * BLOCK_SIZE, (who, route, prompt)
    assert cached == 0, (who, route)
    full = prompt // BLOCK_SIZE * BLOCK_SIZE
    if written is not None:
        assert written == full, (who, route, written, full)
    again, hit, rewritten = prompt_usage(route, stream_usage(route, run["events"]))
    assert again == prompt and hit == (prompt - 1) // BLOCK_SIZE * BLOCK_SIZE, (who, route)
    if rewritten is not None:
        assert rewritten == full - hit, (who, route)
    assert prompt_usage(route, run["other"]["usage"])[1] == 0, (who, route)
    if route == "/v1/messages":
        assert run["counted"] == {
            "input_tokens": prompt,
            "context_management": {"original_input_tokens": prompt},
        }, who
        start = next(d for k, d in run["events"] if k == "message_start")
        assert start["message"]["usage"] == {"input_tokens": prompt, "output_tokens": 0}, who


GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")


def test_8_generation_routes_answer_alike_with_the_same_cache_accounting(fleet: Fleet) -> None:
    replica = fleet.replicas[0]

    async def main() -> None:
        async with sim_like(fleet) as sim:
            for route in GENERATION_ROUTES:
                real = await generation_run(replica.url, fleet.api_key, route)
                simulated = await generation_run(sim.url, fleet.api_key, route)
                check_accounting(route, real, "vLLM")
                check_accounting(route, simulated, "simulator")
                assert simulated["content_type"] == real["content_type"]
                for key in ("first", "other", "counted"):
                    assert_same_shape(simulated[key], real[key], f"{route} {key}")
                assert_same_stream(simulated["events"], real["events"], f"{route} stream")

    asyncio.run(main())


# ------------------------------------------------------------------------------ errors

LONG_IDS = [10] * (CONTEXT + 1)
MSG = [{"role": "user", "content": "x"}]
BAD_REQUESTS: list[tuple[str, object]] = [
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "cache_salt": ""}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "cache_salt": 7}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "cache_salt": "a/b"}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "cache_salt": "s" * 129}),
    ("/v1/completions", {"model": "nope", "prompt": "x"}),
    ("/v1/completions", b'{"model": "tiny", "prompt": '),
    ("/v1/completions", b'{"model": "tiny"}}'),
    ("/v1/completions", b"[1, 2]"),
    ("/v1/completions", b""),
    ("/v1/completions", {"model": MODEL_NAME}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": 5}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": []}),
    ("/v1/completions", {"model": 5, "prompt": "x"}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": "five"}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 1.5}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 0}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 99999}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": LONG_IDS}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "stream": "maybe"}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "stream_options": {"a": 1}}),
    ("/v1/chat/completions", {"model": MODEL_NAME}),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": "hi"}),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": []}),
    ("/v1/chat/completions", {"model": "nope", "messages": MSG}),
    ("/v1/responses", {"model": MODEL_NAME, "input": "x", "cache_salt": "a@b"}),
    ("/v1/responses", {"model": "nope", "input": "x"}),
    ("/v1/responses", {"model": MODEL_NAME}),
    ("/v1/responses", {"model": MODEL_NAME, "input": 5}),
    ("/v1/responses", {"model": MODEL_NAME, "input": "x", "max_output_tokens": 0}),
    ("/v1/responses", {"model": MODEL_NAME, "input": "x", "max_output_tokens": 99999}),
    ("/v1/messages", {"model": MODEL_NAME, "messages": MSG, "max_tokens": 2, "cache_salt": ""}),
    ("/v1/messages", {"model": MODEL_NAME, "messages": MSG, "max_tokens": 2, "cache_salt": 5}),
    ("/v1/messages", {"model": MODEL_NAME, "messages": MSG, "max_tokens": 2, "cache_salt": "@"}),
    ("/v1/messages", {"model": "nope", "messages": MSG, "max_tokens": 2, "stream": True}),
    ("/v1/messages", {"model": MODEL_NAME, "messages": MSG}),
    ("/v1/messages", {"messages": MSG, "max_tokens": 2}),
    ("/v1/messages", {"model": "", "messages": MSG, "max_tokens": 2}),
    ("/v1/messages", {"model": MODEL_NAME, "messages": MSG, "max_tokens": 0}),
    (
        "/v1/messages",
        {"model": MODEL_NAME, "messages": [{"role": "x", "content": "y"}], "max_tokens": 2},
    ),
    ("/v1/messages", {"model": MODEL_NAME, "messages": [], "max_tokens": 2}),
    ("/v1/messages", b'{"model": "tiny", "max_tokens": 2'),
    ("/tokenize", {"model": "nope", "prompt": "x"}),
    ("/detokenize", {"model": MODEL_NAME, "tokens": "x"}),
    ("/v1/nothing", {}),
]


async def answers(url: str, api_key: str) -> list[tuple[int, object]]:
    out: list[tuple[int, object]] = []
    async with client(url, api_key) as c:
        for route, body in BAD_REQUESTS:
            raw = body if isinstance(body, bytes) else orjson.dumps(body)
            resp = await c.post(route, content=raw, headers={"content-type": "application/json"})
            out.append((resp.status_code, resp.json()))
        typeless = await c.post("/v1/completions", content=b'{"prompt": "x"}')
        out.append((typeless.status_code, typeless.json()))
        wrong_method = await c.get("/v1/chat/completions")
        out.append((wrong_method.status_code, wrong_method.json()))
    return out


def test_9_bad_requests_get_byte_identical_errors(fleet: Fleet) -> None:
    """Status and body equal for each: vLLM's own checks (with `param` and the
    " (parameter=...)" suffix), pydantic's schema errors, JSON and media-type errors,
    unknown model (with the aliases), Anthropic's shape on /v1/messages, FastAPI's 404/405."""

    async def main() -> None:
        real = await answers(fleet.replicas[0].url, fleet.api_key)
        async with sim_like(fleet) as sim:
            simulated = await answers(sim.url, fleet.api_key)
        labels = [f"{r} {b!r}" for r, b in BAD_REQUESTS] + ["no content-type", "GET"]
        for label, got, want in zip(labels, simulated, real, strict=True):
            assert got == want, label
        assert {status for status, _ in real} == {400, 404, 405}

    asyncio.run(main())


# ------------------------------------------------------------------------------ other routes

FAMILY = re.compile(r"^# (HELP|TYPE) (vllm:\S+) (.*)$")
SAMPLE = re.compile(r"^(vllm:[^{ ]+)\{([^}]*)\}")


def metric_families(text: str) -> tuple[list[tuple[str, str, str]], dict[str, set[str]]]:
    """(HELP/TYPE lines in order, label names per sample name) of vLLM's metrics."""
    lines = [m.groups() for m in map(FAMILY.match, text.splitlines()) if m]
    labels: dict[str, set[str]] = {}
    for m in map(SAMPLE.match, text.splitlines()):
        if m and m.group(1) != "vllm:cache_config_info":
            labels.setdefault(m.group(1), set()).update(re.findall(r'(\w+)="', m.group(2)))
    return [(kind, name, rest) for kind, name, rest in lines], labels


async def other_routes(url: str, api_key: str) -> dict[str, Any]:
    async with client(url, api_key) as c:
        tokenized = await c.post("/tokenize", json={"model": MODEL_NAME, "prompt": PROMPT})
        chat = await c.post(
            "/tokenize", json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
        )
        strs = await c.post(
            "/tokenize", json={"model": MODEL_NAME, "prompt": "a b", "return_token_strs": True}
        )
        done = await c.post(
            "/v1/completions",
            json={"model": MODEL_NAME, "prompt": [10, 11, 12], "max_tokens": 2},
        )
        detok = await c.post(
            "/detokenize", json={"model": MODEL_NAME, "tokens": tokenized.json()["tokens"][:5]}
        )
        async with async_client(base_url=url, timeout=60) as anonymous:
            open_routes = [
                (await anonymous.post(path, json=body)).status_code
                for path, body in (
                    ("/tokenize", {"prompt": "x"}),
                    ("/detokenize", {"tokens": [20]}),
                )
            ]
            guarded = [
                (await anonymous.post(path, json={})).status_code
                for path in ("/v1/responses", "/v1/messages", "/v1/embeddings", "/v2/rerank")
            ]
            metrics = (await anonymous.get("/metrics")).text
    return {
        "tokenize": tokenized.json(),
        "tokenize_chat": chat.json(),
        "token_strs": strs.json(),
        "completion": done.json(),
        "detokenize": detok.json(),
        "open": open_routes,
        "guarded": guarded,
        "metrics": metric_families(metrics),
    }


def test_10_tokenizer_routes_auth_and_metrics_match(fleet: Fleet) -> None:
    """/tokenize and /detokenize (open without the API key, like /metrics: vLLM guards only
    /v1, /v2, /inference, /cohere), and the metric families the simulator exports: each is
    one of vLLM's, with its HELP text, type, label names and place in the page."""

    async def main() -> None:
        real = await other_routes(fleet.replicas[0].url, fleet.api_key)
        async with sim_like(fleet) as sim:
            simulated = await other_routes(sim.url, fleet.api_key)
        for key in ("tokenize", "tokenize_chat", "token_strs", "completion", "detokenize"):
            assert_same_shape(simulated[key], real[key], key)
        for who in (real, simulated):
            assert who["tokenize"]["count"] == len(who["tokenize"]["tokens"])
            assert who["tokenize"]["max_model_len"] == CONTEXT
            assert who["token_strs"]["token_strs"] and who["tokenize_chat"]["count"] > 1
            assert who["open"] == [200, 200] and who["guarded"] == [401] * 4
        sim_lines, sim_labels = simulated["metrics"]
        real_lines, real_labels = real["metrics"]
        assert [line for line in real_lines if line in sim_lines] == sim_lines
        for name, labels in sim_labels.items():
            assert labels == real_labels[name], name

    asyncio.run(main())


# ------------------------------------------------------------------------------ pooling


def pooling_requests(salt: str) -> list[tuple[int, str, dict[str, Any]]]:
    """(replica: 0 embedding, 1 classifier; route; body) of each pooling request."""
    docs = ["Hello there", "Bye now", "x y z"]
    m = {"model": MODEL_NAME}
    return [
        (0, "/v1/embeddings", {**m, "input": PROMPT, "cache_salt": salt}),
        (0, "/v1/embeddings", {**m, "input": ["a b c", "d e"], "encoding_format": "base64"}),
        (0, "/v1/embeddings", {**m, "input": [[20, 21, 22], [23, 24]]}),
        (0, "/v1/embeddings", {**m, "messages": [{"role": "user", "content": "hi"}]}),
        (0, "/pooling", {**m, "input": "Hello world", "cache_salt": salt}),
        (0, "/score", {**m, "queries": "Hello world", "documents": docs, "cache_salt": salt}),
        (0, "/v1/score", {**m, "text_1": "Hello world", "text_2": docs[0]}),
        (0, "/rerank", {**m, "query": "Hello world", "documents": docs, "top_n": 2}),
        (0, "/v1/rerank", {**m, "query": "Hello world", "documents": docs, "cache_salt": salt}),
        (0, "/v2/rerank", {**m, "query": "Hello world", "documents": docs}),
        (1, "/classify", {**m, "input": ["Hello world", "bye"], "cache_salt": salt}),
        (1, "/classify", {**m, "messages": [{"role": "user", "content": "hi"}]}),
        (1, "/pooling", {**m, "input": "Hello world"}),
    ]


POOLING_ERRORS: list[tuple[int, str, dict[str, Any]]] = [
    (0, "/v1/embeddings", {"model": MODEL_NAME, "input": "x", "cache_salt": "a/b"}),
    (0, "/v1/embeddings", {"model": MODEL_NAME, "input": "x", "cache_salt": ""}),
    (0, "/v1/embeddings", {"model": "nope", "input": "x"}),
    (0, "/v1/embeddings", {"model": MODEL_NAME, "input": []}),
    (0, "/v1/embeddings", {"model": MODEL_NAME, "input": "x", "dimensions": 4}),
    (0, "/rerank", {"model": MODEL_NAME, "query": "a", "documents": ["b"], "cache_salt": "@"}),
    (0, "/rerank", {"model": "nope", "query": "a", "documents": ["b"]}),
    (1, "/classify", {"model": MODEL_NAME, "input": "x", "cache_salt": "a/b"}),
]


async def tokens_of(c: httpx.AsyncClient, texts: list[str]) -> int:
    total = 0
    for t in texts:
        total += (await c.post("/tokenize", json={"model": MODEL_NAME, "prompt": t})).json()[
            "count"
        ]
    return total


def check_pooling_usage(
    route: str, body: dict[str, Any], answer: dict[str, Any], used: int
) -> None:
    """Pooling usage: prompt tokens only (every text embedded once), no cache details."""
    usage = answer["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] == used, (route, usage, used)
    if "rerank" not in route:
        assert usage["completion_tokens"] == 0 and usage["prompt_tokens_details"] is None


async def pooling_run(urls: list[str], api_key: str, salt: str) -> dict[str, Any]:
    out: dict[str, Any] = {"answers": [], "errors": [], "missing": []}
    clients = [client(u, api_key) for u in urls]
    try:
        for i, route, body in pooling_requests(salt):
            resp = await clients[i].post(route, json=body)
            assert resp.status_code == 200, (route, resp.text)
            texts = [body[k] for k in ("input", "queries", "text_1", "query") if k in body]
            texts += body.get("documents", []) + ([body["text_2"]] if "text_2" in body else [])
            flat = [t for x in texts for t in ([x] if isinstance(x, str) else x)]
            if flat and all(isinstance(t, str) for t in flat):
                check_pooling_usage(route, body, resp.json(), await tokens_of(clients[i], flat))
            out["answers"].append(resp.json())
        for i, route, body in POOLING_ERRORS:
            resp = await clients[i].post(route, json=body)
            out["errors"].append((resp.status_code, resp.json()))
    finally:
        for c in clients:
            await c.aclose()
    return out


def test_11_pooling_routes_answer_alike_and_salt_the_prefix_cache(
    fleet: Fleet, pooling_fleet: Fleet
) -> None:
    """An embedding and a classifier replica against one simulator; then the point for the
    gateway: a pooling prefill stores salted blocks (the salt in block 0's extra keys) and
    hits only under the same salt, so these routes must be salted like generation."""
    embed, classify = pooling_fleet.replicas

    async def main() -> None:
        salt = f"pool-{RUN}"
        real = await pooling_run([embed.url, classify.url], pooling_fleet.api_key, salt)
        async with sim_like(pooling_fleet, events=True) as sim:
            simulated = await pooling_run([sim.url, sim.url], pooling_fleet.api_key, salt)
            sim_events = await salted_prefill(sim.url, pooling_fleet.api_key, sim_replay(sim))
        requests = pooling_requests(salt)
        for (_, route, _), got, want in zip(
            requests, simulated["answers"], real["answers"], strict=True
        ):
            assert_same_shape(got, want, route)
        for (_, route, _), got, want in zip(
            POOLING_ERRORS, simulated["errors"], real["errors"], strict=True
        ):
            assert got == want, route
        real_events = await salted_prefill(embed.url, pooling_fleet.api_key, replica_replay(embed))
        for who, (salts, hits) in (("vLLM", real_events), ("simulator", sim_events)):
            assert salts == {(f"emb-{RUN}",)}, who
            assert hits == [0.0, 0.0, 1.0], who  # same salt hits; another salt, no salt: miss
        # A generation replica serves none of them (vLLM picks routes by the model's task).
        async with client(fleet.replicas[0].url, fleet.api_key) as c:
            for path in (
                "/v1/embeddings",
                "/pooling",
                "/classify",
                "/score",
                "/rerank",
                "/v1/audio/transcriptions",
            ):
                resp = await c.post(path, json={"model": MODEL_NAME, "input": "x"})
                assert (resp.status_code, resp.json()) == (404, {"detail": "Not Found"}), path

    asyncio.run(main())


def sim_replay(sim: RunningSim) -> Any:
    assert sim.publisher is not None and sim.publisher.bound_replay_endpoint
    endpoint = sim.publisher.bound_replay_endpoint
    return lambda start: [e for _, p in raw_stream(endpoint, start) for e in decode_batch(p).events]


def replica_replay(replica: VllmReplica) -> Any:
    return lambda start: events_since(replica, start)


async def salted_prefill(
    url: str, api_key: str, events_from: Any
) -> tuple[set[tuple[str, ...]], list[float]]:
    """Embed one prompt under a salt, then again (same salt, another, none): the salts in
    the stored blocks' extra keys, and whether each repeat hit the cache (from /metrics)."""
    text_in = long_prompt(f"emb{RUN}x", 60)
    salt = f"emb-{RUN}"
    async with client(url, api_key) as c:

        async def hits() -> float:
            page = (await c.get("/metrics")).text
            return sum(
                float(line.rsplit(" ", 1)[1])
                for line in page.splitlines()
                if line.startswith("vllm:prefix_cache_hits_total")
            )

        start = len(events_from(0))
        await c.post(
            "/v1/embeddings", json={"model": MODEL_NAME, "input": text_in, "cache_salt": salt}
        )
        blocks = stored(events_from(0)[start:])
        seen: list[float] = []
        for extra in ({"cache_salt": f"other-{RUN}"}, {}, {"cache_salt": salt}):
            before = await hits()
            await c.post("/v1/embeddings", json={"model": MODEL_NAME, "input": text_in, **extra})
            seen.append(float(await hits() > before))
    salts = {
        tuple(str(k) for k in e.extra_keys[0]) for e in blocks if e.extra_keys and e.extra_keys[0]
    }
    return salts, seen
