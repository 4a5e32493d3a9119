"""`saltgate sim` beyond completions: /v1/responses, /v1/messages, the pooling routes, the
tokenizer routes and the metrics, over real HTTP on loopback (shapes per docs/conformance.md;
tests/conformance compares them with real vLLM)."""

from __future__ import annotations

import base64
import time
from array import array
from typing import Any

import httpx
import orjson
import pytest
from tests.support.completions import SIM_MODEL as MODEL
from tests.support.sim import run, sim
from tests.support.waiting import eventually

from saltgate.sim.shapes import EMBEDDING_DIM
from saltgate.sim.tokenizer import apply_chat_template, tokenize

LONG = "The quick brown fox jumps over the lazy dog while the cache warms. " * 12


async def post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = await client.post(path, json={"model": MODEL, **body})
    assert resp.status_code == 200, resp.text
    doc: dict[str, Any] = resp.json()
    return doc


async def sse(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[tuple[str, Any]]:
    """(event name, data) of each server-sent event; the name is "" when none is sent."""
    events: list[tuple[str, Any]] = []
    async with client.stream("POST", path, json={"model": MODEL, **body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
        name = ""
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
                events.append((name, data if data == "[DONE]" else orjson.loads(data)))
                name = ""
    return events


def full_blocks(tokens: int, block_size: int = 16) -> int:
    return tokens // block_size * block_size


# ------------------------------------------------------------------------ /v1/responses


def test_responses_usage_counts_cached_and_written_blocks_per_salt() -> None:
    async def main() -> None:
        async with sim() as (_, client):
            body = {"input": LONG, "max_output_tokens": 5, "cache_salt": "tenant-a"}
            first = await post(client, "/v1/responses", body)
            prompt = len(apply_chat_template([{"role": "user", "content": LONG}]))
            usage = first["usage"]
            assert usage["input_tokens"] == prompt and usage["output_tokens"] == 5
            assert usage["total_tokens"] == prompt + 5
            assert usage["input_tokens_details"]["cached_tokens"] == 0
            assert usage["input_tokens_details"]["cache_write_tokens"] == full_blocks(prompt)
            repeat = (await post(client, "/v1/responses", body))["usage"]["input_tokens_details"]
            assert repeat["cached_tokens"] == full_blocks(prompt - 1)
            assert repeat["cache_write_tokens"] == full_blocks(prompt) - repeat["cached_tokens"]
            other = await post(client, "/v1/responses", {**body, "cache_salt": "tenant-b"})
            assert other["usage"]["input_tokens_details"]["cached_tokens"] == 0
            # the answer: a message whose text has the 5 tokens; max_output_tokens reached
            assert first["object"] == "response" and first["status"] == "incomplete"
            assert first["incomplete_details"] == {"reason": "max_output_tokens"}
            (item,) = first["output"]
            assert (item["type"], item["role"], item["status"]) == (
                "message",
                "assistant",
                "completed",
            )
            assert len(tokenize(item["content"][0]["text"])) == 5
            assert first["max_output_tokens"] == 5

    run(main)


def test_responses_input_forms_and_instructions_count_as_chat_turns() -> None:
    async def main() -> None:
        async with sim() as (_, client):
            plain = await post(client, "/v1/responses", {"input": "hello there"})
            parts = [{"type": "input_text", "text": "hello there"}]
            listed = await post(
                client, "/v1/responses", {"input": [{"role": "user", "content": parts}]}
            )
            assert plain["usage"]["input_tokens"] == listed["usage"]["input_tokens"]
            told = await post(
                client, "/v1/responses", {"input": "hello there", "instructions": "Be brief."}
            )
            expected = apply_chat_template(
                [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "hello there"},
                ]
            )
            assert told["usage"]["input_tokens"] == len(expected)
            assert told["instructions"] == "Be brief."
            assert plain["max_output_tokens"] == 16  # the simulator's default output length

    run(main)


def test_responses_stream_sends_typed_events_in_vllms_order() -> None:
    async def main() -> None:
        async with sim(block_size=16) as (_, client):
            body = {"input": LONG, "max_output_tokens": 3, "cache_salt": "s"}
            await post(client, "/v1/responses", body)
            events = await sse(client, "/v1/responses", body)
            names = [name for name, _ in events]
            assert names == [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                *["response.output_text.delta"] * 3,
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
            assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
            assert all(data["type"] == name for name, data in events)
            assert events[0][1]["response"]["status"] == "in_progress"
            assert events[0][1]["response"]["usage"] is None
            deltas = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
            assert events[7][1]["text"] == deltas
            completed = events[-1][1]["response"]
            assert completed["output"][0]["content"][0]["text"] == deltas
            usage = completed["usage"]
            assert usage["output_tokens"] == 3
            assert usage["input_tokens_details"]["cached_tokens"] > 0  # the repeat hit

    run(main)


def test_responses_stream_announces_itself_before_the_prefill() -> None:
    """vLLM sends response.created at once and the output item with the first token."""

    async def main() -> None:
        async with sim(prefill_ms_per_1k_tokens=2000, decode_ms_per_token=0) as (_, client):
            arrivals: dict[str, float] = {}
            start = time.perf_counter()
            body = {"model": MODEL, "input": LONG, "max_output_tokens": 1, "stream": True}
            async with client.stream("POST", "/v1/responses", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("event: "):
                        arrivals.setdefault(line[7:], time.perf_counter() - start)
            prefill = 2.0 * len(apply_chat_template([{"role": "user", "content": LONG}])) / 1000
            assert arrivals["response.created"] < prefill / 2
            assert arrivals["response.output_item.added"] >= prefill * 0.9

    run(main)


# ------------------------------------------------------------------------ /v1/messages


def test_messages_split_usage_like_anthropic_and_stream_it() -> None:
    async def main() -> None:
        async with sim() as (_, client):
            body = {
                "system": "You are terse.",
                "messages": [{"role": "user", "content": [{"type": "text", "text": LONG}]}],
                "max_tokens": 4,
                "cache_salt": "tenant-a",
            }
            counted = await post(client, "/v1/messages/count_tokens", body)
            prompt = counted["input_tokens"]
            assert counted == {
                "input_tokens": prompt,
                "context_management": {"original_input_tokens": prompt},
            }
            assert prompt == len(
                apply_chat_template(
                    [
                        {"role": "system", "content": "You are terse."},
                        {"role": "user", "content": LONG},
                    ]
                )
            )
            first = await post(client, "/v1/messages", body)
            assert first["type"] == "message" and first["stop_reason"] == "max_tokens"
            assert first["usage"] == {
                "input_tokens": prompt - full_blocks(prompt),
                "output_tokens": 4,
                "cache_creation_input_tokens": full_blocks(prompt),
                "cache_read_input_tokens": 0,
            }
            assert len(tokenize(first["content"][0]["text"])) == 4
            events = await sse(client, "/v1/messages", body)
            names = [name for name, _ in events]
            assert names == [
                "message_start",
                "content_block_start",
                *["content_block_delta"] * 4,
                "content_block_stop",
                "message_delta",
                "message_stop",
            ]
            assert all(data["type"] == name for name, data in events)
            start = events[0][1]["message"]
            assert start["usage"] == {"input_tokens": prompt, "output_tokens": 0}
            usage = events[-2][1]["usage"]
            read = full_blocks(prompt - 1)
            assert usage["cache_read_input_tokens"] == read
            assert usage["cache_creation_input_tokens"] == full_blocks(prompt) - read
            assert usage["input_tokens"] + read + usage["cache_creation_input_tokens"] == prompt
            assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}

    run(main)


@pytest.mark.parametrize(
    ("body", "status", "anthropic", "needle"),
    [
        ({"cache_salt": "a/b"}, 400, True, "(parameter=cache_salt)"),
        ({"model": "nope"}, 404, True, "Valid aliases: sim-model."),
        ({"cache_salt": ""}, 400, False, "'string_too_short', 'loc': 'body.cache_salt'"),
        ({"max_tokens": 0}, 400, False, "max_tokens must be positive"),
        ({"messages": []}, 400, True, "empty conversation"),
    ],
)
def test_messages_errors_come_in_the_shape_vllm_uses(
    body: dict[str, Any], status: int, anthropic: bool, needle: str
) -> None:
    """The route's own errors in Anthropic's shape; schema errors in the OpenAI shape."""

    async def main() -> None:
        async with sim() as (_, client):
            base = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
            resp = await client.post("/v1/messages", json={**base, **body})
            assert resp.status_code == status
            doc = resp.json()
            if anthropic:
                assert doc["type"] == "error" and set(doc["error"]) == {"type", "message"}
                assert needle in doc["error"]["message"]
            else:
                assert doc["error"]["type"] == "Bad Request" and needle in doc["error"]["message"]

    run(main)


def test_responses_check_the_salt_and_the_model_like_vllm() -> None:
    async def main() -> None:
        async with sim() as (_, client):
            bad = await client.post(
                "/v1/responses", json={"model": MODEL, "input": "x", "cache_salt": "a@b"}
            )
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
            unknown = await client.post("/v1/responses", json={"model": "nope", "input": "x"})
            assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
            missing = await client.post("/v1/responses", json={"model": MODEL})
            assert missing.json()["error"]["param"] == "body.input"

    run(main)


# ------------------------------------------------------------------------ pooling routes


def test_embeddings_are_deterministic_unit_vectors_and_meter_prompt_tokens() -> None:
    async def main() -> None:
        async with sim() as (_, client):
            doc = await post(client, "/v1/embeddings", {"input": ["alpha beta", "gamma"]})
            assert doc["object"] == "list" and doc["id"].startswith("embd-")
            one, two = (d["embedding"] for d in doc["data"])
            assert len(one) == EMBEDDING_DIM and abs(sum(v * v for v in one) - 1) < 1e-5
            assert one != two
            assert doc["usage"] == {
                "prompt_tokens": len(tokenize("alpha beta")) + len(tokenize("gamma")),
                "total_tokens": len(tokenize("alpha beta")) + len(tokenize("gamma")),
                "completion_tokens": 0,
                "prompt_tokens_details": None,
                "completion_tokens_details": None,
            }
            again = await post(client, "/v1/embeddings", {"input": "alpha beta"})
            assert again["data"][0]["embedding"] == one
            b64 = await post(
                client, "/v1/embeddings", {"input": "alpha beta", "encoding_format": "base64"}
            )
            packed = base64.b64decode(b64["data"][0]["embedding"])
            assert list(array("f", packed)) == one
            pooled = await post(client, "/pooling", {"input": "alpha beta"})
            assert pooled["data"][0] == {"index": 0, "object": "pooling", "data": one}
            ids = await post(client, "/v1/embeddings", {"input": tokenize("alpha beta")})
            assert ids["data"][0]["embedding"] == one

    run(main)


def prefix_hits(metrics: str) -> float:
    line = next(x for x in metrics.splitlines() if x.startswith("vllm:prefix_cache_hits_total"))
    return float(line.rsplit(" ", 1)[1])


def test_pooling_requests_go_through_the_salted_prefix_cache() -> None:
    """As in vLLM: an embedding prefill hits the cache (no cached_tokens in its usage, but
    the hit shows in the metrics and in time), and only under the same salt."""

    async def main() -> None:
        async with sim() as (_, client):
            body = {"input": LONG, "cache_salt": "tenant-a"}
            await post(client, "/v1/embeddings", body)
            before = prefix_hits((await client.get("/metrics")).text)
            await post(client, "/v1/embeddings", {**body, "cache_salt": "tenant-b"})
            await post(client, "/v1/embeddings", {"input": LONG})
            assert prefix_hits((await client.get("/metrics")).text) == before
            await post(client, "/v1/embeddings", body)
            hits = prefix_hits((await client.get("/metrics")).text) - before
            assert hits == full_blocks(len(tokenize(LONG)) - 1)
            bad = await client.post(
                "/v1/embeddings", json={"model": MODEL, "input": "x", "cache_salt": "a/b"}
            )
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
            unknown = await client.post("/v1/embeddings", json={"model": "nope", "input": "x"})
            assert unknown.json()["error"] == {
                "message": "The model `nope` does not exist.",
                "type": "NotFoundError",
                "param": None,
                "code": 404,
            }

    run(main)


def test_classify_score_and_rerank_answer_vllm_shapes() -> None:
    async def main() -> None:
        async with sim() as (_, client):
            classified = await post(client, "/classify", {"input": ["good", "bad"]})
            for i, row in enumerate(classified["data"]):
                assert row["index"] == i and row["num_classes"] == 2
                assert abs(sum(row["probs"]) - 1) < 1e-6
                assert row["label"] == f"LABEL_{row['probs'].index(max(row['probs']))}"
            docs = ["a fox", "the lazy dog", "quantum chromodynamics"]
            tokens = len(tokenize("fox")) + sum(len(tokenize(d)) for d in docs)
            scored = await post(client, "/score", {"queries": "fox", "documents": docs})
            scores = [row["score"] for row in scored["data"]]
            assert scored["usage"]["prompt_tokens"] == tokens and len(scores) == 3
            assert all(-1 <= s <= 1 for s in scores)
            legacy = await post(client, "/v1/score", {"text_1": "fox", "text_2": docs})
            assert [row["score"] for row in legacy["data"]] == scores
            for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
                ranked = await post(client, path, {"query": "fox", "documents": docs, "top_n": 2})
                assert ranked["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
                best = sorted(range(3), key=lambda i: -scores[i])[:2]
                assert [r["index"] for r in ranked["results"]] == best
                assert [r["document"] for r in ranked["results"]] == [
                    {"text": docs[i], "multi_modal": None} for i in best
                ]
                assert [r["relevance_score"] for r in ranked["results"]] == [
                    scores[i] for i in best
                ]

    run(main)


# ------------------------------------------------------------------------ tokenizer routes


def test_tokenize_and_detokenize_are_open_like_vllms_and_round_trip_output() -> None:
    """vLLM's --api-key guards only /v1, /v2, /inference and /cohere paths."""

    async def main() -> None:
        async with sim(api_key="k") as (_, client):
            auth = {"authorization": "bearer k"}  # the scheme in any case, as vLLM takes it
            done = await client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "x", "max_tokens": 6},
                headers=auth,
            )
            text = done.json()["choices"][0]["text"]
            tok = await post(client, "/tokenize", {"prompt": text, "cache_salt": "ignored/@"})
            assert tok["tokens"] == tokenize(text) and tok["count"] == 6
            assert tok["max_model_len"] == 32768 and tok["token_strs"] is None
            back = await post(client, "/detokenize", {"tokens": tok["tokens"]})
            assert back == {"prompt": text}
            chat = await post(
                client, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}
            )
            assert chat["tokens"] == apply_chat_template([{"role": "user", "content": "hi"}])
            strs = await post(client, "/tokenize", {"prompt": "a b", "return_token_strs": True})
            assert strs["token_strs"] == ["a", " b"]
            for path in ("/v1/embeddings", "/v1/rerank", "/v2/rerank", "/v1/messages"):
                assert (await client.post(path, json={})).status_code == 401
            for path in ("/pooling", "/classify", "/score", "/rerank"):
                assert (await client.post(path, json={"model": MODEL})).status_code == 400

    run(main)


# ------------------------------------------------------------------------ metrics


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of the exposition text, its labels written as vLLM sorts them."""
    pairs = sorted({"engine": "0", "model_name": MODEL, **labels}.items())
    key = f"vllm:{name}{{" + ",".join(f'{k}="{v}"' for k, v in pairs) + "}"
    line = next(x for x in text.splitlines() if x.startswith(key + " "))
    return float(line.rsplit(" ", 1)[1])


def test_metrics_count_tokens_reasons_and_latencies_like_vllm() -> None:
    async def main() -> None:
        async with sim(decode_ms_per_token=5) as (_, client):
            await post(client, "/v1/completions", {"prompt": LONG, "max_tokens": 4})
            await post(client, "/v1/completions", {"prompt": LONG, "max_tokens": 4})
            await post(client, "/v1/embeddings", {"input": "x"})
            body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                async for _ in resp.aiter_lines():
                    break  # the client goes away after the first chunk

            async def aborted() -> bool:  # the engine sees it once the stream is closed
                page = (await client.get("/metrics")).text
                return metric(page, "request_success_total", finished_reason="abort") == 1

            await eventually(aborted, what="the closed stream counted as an abort")
            text = (await client.get("/metrics")).text
            success = {
                r: metric(text, "request_success_total", finished_reason=r)
                for r in ("stop", "length", "abort")
            }
            assert success == {"stop": 1, "length": 2, "abort": 1}  # embeddings finish "stop"
            prompt = len(tokenize(LONG))
            cached = full_blocks(prompt - 1)
            assert metric(text, "prompt_tokens_total") == 2 * prompt + 2
            assert metric(text, "request_prompt_tokens_sum") == 2 * prompt + 2
            assert metric(text, "prompt_tokens_cached_total") == cached
            assert metric(text, "prompt_tokens_by_source_total", source="local_cache_hit") == cached
            assert metric(text, "prompt_tokens_cached_by_source_total", source="device") == cached
            assert metric(text, "request_prefill_kv_computed_tokens_sum") == 2 * prompt + 2 - cached
            assert metric(text, "time_to_first_token_seconds_count") == 4
            assert metric(text, "e2e_request_latency_seconds_count") == 4
            generated = metric(text, "generation_tokens_total")
            assert generated >= 4 + 4 + 1
            # one inter-token gap per token after a request's first; buckets are cumulative
            gaps = metric(text, "inter_token_latency_seconds_count")
            assert gaps == generated - 3
            assert metric(text, "inter_token_latency_seconds_bucket", le="+Inf") == gaps
            assert metric(text, "inter_token_latency_seconds_sum") >= 0.005 * gaps * 0.9
            assert metric(text, "request_success_created", finished_reason="stop") > 1e9

    run(main)
