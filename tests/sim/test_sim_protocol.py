"""The simulator's pure parts: vLLM's request checks and error wording, its metrics text."""

from __future__ import annotations

import json
from typing import Any

import pytest

from saltgate.sim.errors import SimError, anthropic_error_body, invalid_json, openai_error_body
from saltgate.sim.metrics import Histogram, RequestTimes, SimMetrics, render
from saltgate.sim.protocol import (
    DEFAULT_MAX_TOKENS,
    Limits,
    lax_bool,
    lax_int,
    parse_completion,
    parse_messages,
    parse_responses,
    read_json,
)
from saltgate.sim.tokenizer import apply_chat_template

pytestmark = pytest.mark.unit

LIMITS = Limits("m", 100)
JSON = b"application/json"


def refused(call: Any, *args: Any, **kwargs: Any) -> SimError:
    with pytest.raises(SimError) as info:
        call(*args, **kwargs)
    return info.value


@pytest.mark.parametrize(
    ("value", "expected"), [(5, 5), ("7", 7), (3.0, 3), (True, 1), (None, None)]
)
def test_lax_int_reads_what_pydantic_accepts(value: object, expected: int | None) -> None:
    assert lax_int({"n": value}, "n") == expected


@pytest.mark.parametrize(
    ("value", "kind"), [("five", "int_parsing"), (1.5, "int_from_float"), ([1], "int_type")]
)
def test_lax_int_refuses_with_pydantics_error(value: object, kind: str) -> None:
    error = refused(lax_int, {"n": value}, "n")
    assert error.param == "body.n" and error.err_type == "Bad Request"
    assert f"'type': '{kind}', 'loc': 'body.n'" in error.message


def test_lax_bool_takes_pydantics_words() -> None:
    assert [lax_bool({"b": v}, "b") for v in ("yes", "off", 1, 0, True, None)] == [
        True,
        False,
        True,
        False,
        True,
        None,
    ]
    assert "bool_parsing" in refused(lax_bool, {"b": "maybe"}, "b").message


@pytest.mark.parametrize("raw", [b'{"a": ', b'{"a": 1}}', b"{'a': 1}", b"\xff"])
def test_invalid_json_names_the_stdlib_error_and_offset(raw: bytes) -> None:
    error = refused(read_json, raw, JSON)
    try:
        json.loads(raw)
    except ValueError as exc:
        expected = invalid_json(exc)
    assert error.message == expected.message
    assert error.message.startswith("1 validation error:\n  {'type': 'json_invalid'")
    assert error.param == expected.param
    assert str(error.param).startswith("body.")


def test_read_json_checks_the_media_type_after_parsing_a_typeless_body() -> None:
    assert read_json(b'{"a": NaN}', JSON)["a"] != 0  # the stdlib's reading, as vLLM's
    assert "Unsupported Media Type" in refused(read_json, b"{}", b"text/plain").message
    assert "Unsupported Media Type" in refused(read_json, b"{}", None).message
    assert "json_invalid" in refused(read_json, b"{", None).message  # parsed first
    assert read_json(b"{}", b"Application/JSON; charset=utf-8") == {}
    assert "'<list of 2 items>'" in refused(read_json, b"[1, 2]", JSON).message


def test_output_budget_follows_vllm() -> None:
    def budget(**body: object) -> int:
        return parse_completion({"prompt": list(range(16, 16 + 90)), **body}, LIMITS).max_tokens

    assert budget() == min(DEFAULT_MAX_TOKENS, 10)
    assert budget(max_tokens=5) == 5
    assert budget(max_tokens=50) == 10  # clamped to what fits the context
    error = refused(budget, max_tokens=101)
    assert error.message.endswith("(parameter=max_tokens, value=101)")
    assert error.param == "max_tokens"
    assert "got 0" in refused(budget, max_tokens=0).message
    too_long = refused(parse_completion, {"prompt": [20] * 101}, LIMITS)
    assert "contains at least 101 input tokens" in too_long.message
    assert too_long.param == "input_tokens"
    full = refused(parse_completion, {"prompt": [20] * 100, "max_tokens": 1}, LIMITS)
    assert "max_tokens must be at least 1, got 0" in full.message


def test_model_may_be_absent_but_not_another() -> None:
    assert parse_completion({"prompt": "x"}, LIMITS).prompt
    assert parse_completion({"prompt": "x", "model": ""}, LIMITS).prompt
    other = refused(parse_completion, {"prompt": "x", "model": "n"}, LIMITS)
    assert (other.status, other.param) == (404, "model")
    assert other.message == "The model `n` does not exist. Valid aliases: m."


def test_responses_input_becomes_chat_turns() -> None:
    req = parse_responses(
        {
            "input": [
                {"type": "message", "role": "developer", "content": "d"},
                {"role": "user", "content": "u"},
            ],
            "instructions": "i",
        },
        Limits("m", 1000),
    )
    turns = [("system", "i"), ("developer", "d"), ("user", "u")]
    assert req.prompt == apply_chat_template([{"role": r, "content": c} for r, c in turns])
    assert req.instructions == "i" and req.requested_max_tokens is None


def test_messages_require_model_and_max_tokens() -> None:
    base: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}]}
    assert refused(parse_messages, {**base, "max_tokens": 1}, LIMITS).param == "body.model"
    assert refused(parse_messages, {**base, "model": "m"}, LIMITS).param == "body.max_tokens"
    req = parse_messages({**base, "model": "m", "max_tokens": 3, "cache_salt": "s"}, LIMITS)
    assert (req.max_tokens, req.cache_salt) == (3, "s")


def test_error_bodies_in_both_shapes() -> None:
    own = SimError(400, "bad salt", param="cache_salt")
    assert json.loads(openai_error_body(own)) == {
        "error": {
            "message": "bad salt",
            "type": "BadRequestError",
            "param": "cache_salt",
            "code": 400,
        }
    }
    assert json.loads(anthropic_error_body(own)) == {
        "type": "error",
        "error": {"type": "BadRequestError", "message": "bad salt"},
    }
    schema = refused(lax_int, {"n": "x"}, "n")
    assert anthropic_error_body(schema) == openai_error_body(schema)  # raised before the route


def test_histograms_render_cumulative_buckets_with_vllms_labels() -> None:
    hist = Histogram((1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 9.0):
        hist.observe(v)
    assert hist.counts == [2, 1, 1] and hist.n == 4 and hist.total == 12.0
    metrics = SimMetrics()
    metrics.finished(
        RequestTimes(
            arrived=0.0,
            admitted=0.25,
            first_token=0.5,
            finished=2.0,
            prompt_tokens=40,
            cached_tokens=32,
            completion_tokens=3,
            finished_reason="length",
        )
    )
    text = render(
        metrics,
        model="m",
        running=0,
        waiting=2,
        kv_usage=0.5,
        queries_tokens=40,
        hits_tokens=32,
        cache_info={"block_size": "16"},
    ).decode()
    lines = set(text.splitlines())
    assert (
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.25",model_name="m"} 0.0' in lines
    )
    assert (
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 1.0' in lines
    )
    assert (
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 1.0' in lines
    )
    assert 'vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 0.25' in lines
    assert 'vllm:request_decode_time_seconds_sum{engine="0",model_name="m"} 1.5' in lines
    assert (
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 2.0'
        in lines
    )
    assert (
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 8.0'
        in lines
    )
    assert (
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 1.0'
        in lines
    )
    assert "# TYPE vllm:prefix_cache_hits_total counter" in lines
    assert "# TYPE vllm:prefix_cache_hits_created gauge" in lines
    assert 'vllm:cache_config_info{block_size="16",engine="0"} 1.0' in lines
