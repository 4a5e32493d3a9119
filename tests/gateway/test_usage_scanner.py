"""The SSE usage scanner, without sockets: any chunking gives the same events and usage."""

from __future__ import annotations

import random

import orjson
import pytest

from saltgate.gateway.usage import (
    SseUsageScanner,
    Usage,
    delivered_usage,
    usage_from_body,
    usage_from_object,
)

pytestmark = pytest.mark.unit


def _event(doc: object) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


USAGE = {
    "prompt_tokens": 40,
    "completion_tokens": 3,
    "prompt_tokens_details": {"cached_tokens": 32},
}
STREAM = (
    _event({"id": "c", "choices": [{"index": 0, "text": "a", "finish_reason": None}]})
    + _event({"id": "c", "choices": [{"index": 0, "text": "b \\n\\n x", "finish_reason": None}]})
    + _event({"id": "c", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    + _event({"id": "c", "choices": [], "usage": USAGE})
    + b"data: [DONE]\n\n"
)


def _scan(chunks: list[bytes], drop: bool) -> tuple[bytes, Usage | None]:
    scanner = SseUsageScanner(drop_usage_event=drop)
    out = b"".join(scanner.feed(c) for c in chunks) + scanner.flush()
    return out, scanner.usage


def test_any_chunking_gives_the_same_result() -> None:
    rng = random.Random(7)
    expected_kept, usage = _scan([STREAM], drop=False)
    expected_dropped, _ = _scan([STREAM], drop=True)
    assert expected_kept == STREAM
    assert usage == Usage(40, 32, 3)
    assert b'"usage"' not in expected_dropped
    assert expected_dropped.endswith(b"data: [DONE]\n\n")
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(STREAM)), rng.randint(1, 12)))
        chunks = [STREAM[a:b] for a, b in zip([0, *cuts], [*cuts, len(STREAM)], strict=True)]
        assert _scan(chunks, drop=False) == (expected_kept, usage)
        assert _scan(chunks, drop=True) == (expected_dropped, usage)


def test_usage_shapes_of_the_three_apis() -> None:
    assert usage_from_object(USAGE) == Usage(40, 32, 3)
    responses = {
        "input_tokens": 50,
        "output_tokens": 5,
        "input_tokens_details": {"cached_tokens": 16},
    }
    assert usage_from_object(responses) == Usage(50, 16, 5)
    anthropic = {"input_tokens": 10, "cache_read_input_tokens": 30, "output_tokens": 2}
    assert usage_from_object(anthropic) == Usage(40, 30, 2)
    # vLLM's first answer to a 434-token prompt: 18 uncached, 416 written to the cache.
    written = {
        "input_tokens": 18,
        "cache_creation_input_tokens": 416,
        "cache_read_input_tokens": 0,
        "output_tokens": 4,
    }
    assert usage_from_object(written) == Usage(434, 0, 4)
    repeat = {**written, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 416}
    assert usage_from_object(repeat) == Usage(434, 416, 4)
    assert usage_from_object({"prompt_tokens": "many"}) == Usage(0, None, 0)
    # Counts no ledger column can hold are garbage, like negative ones.
    too_big = {"prompt_tokens": 10**30, "completion_tokens": 2**31}
    assert usage_from_object(too_big) == Usage(0, None, 0)
    huge = {"input_tokens": 10**9, "cache_read_input_tokens": 10**9, "output_tokens": 1}
    assert usage_from_object(huge) == Usage(2 * 10**9, 10**9, 1)  # still < 2**31
    assert usage_from_object(None) is None
    assert usage_from_body(orjson.dumps({"response": {"usage": responses}})) == Usage(50, 16, 5)
    assert usage_from_body(b"not json") is None


def test_anthropic_stream_usage_is_merged_across_events() -> None:
    stream = _event(
        {"type": "message_start", "message": {"usage": {"input_tokens": 7, "output_tokens": 1}}}
    ) + _event({"type": "message_delta", "usage": {"output_tokens": 9}})
    out, usage = _scan([stream], drop=True)
    assert out == stream  # only OpenAI usage-only chunks are ever removed
    assert usage == Usage(7, None, 9)  # no event said anything of the cache
    # vLLM's shape: message_start has the whole prompt, message_delta the split usage.
    split = {"input_tokens": 18, "cache_read_input_tokens": 416, "output_tokens": 9}
    stream = _event(
        {"type": "message_start", "message": {"usage": {"input_tokens": 434, "output_tokens": 0}}}
    ) + _event({"type": "message_delta", "usage": split})
    assert _scan([stream], drop=True)[1] == Usage(434, 416, 9)


def test_unreported_cached_tokens_are_unknown_never_0() -> None:
    """vLLM without --enable-prompt-tokens-details: no count (or null) is None, on every
    shape; a reported 0 stays 0."""
    plain = {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43}
    assert usage_from_object(plain) == Usage(40, None, 3)
    assert usage_from_object({**plain, "prompt_tokens_details": None}) == Usage(40, None, 3)
    null = {**plain, "prompt_tokens_details": {"cached_tokens": None}}
    assert usage_from_object(null) == Usage(40, None, 3)
    garbage = {**plain, "prompt_tokens_details": {"cached_tokens": -1}}
    assert usage_from_object(garbage) == Usage(40, None, 3)
    zero = {**plain, "prompt_tokens_details": {"cached_tokens": 0}}
    assert usage_from_object(zero) == Usage(40, 0, 3)
    # Anthropic from vLLM without the flag: no cache fields, input_tokens the whole prompt.
    anthropic = {"input_tokens": 434, "output_tokens": 4}
    assert usage_from_object(anthropic) == Usage(434, None, 4)
    responses = {"input_tokens": 50, "output_tokens": 5, "input_tokens_details": {}}
    assert usage_from_object(responses) == Usage(50, None, 5)
    # A chat stream's usage chunk without the details key.
    stream = _event({"choices": [], "usage": plain}) + b"data: [DONE]\n\n"
    assert _scan([stream], drop=True)[1] == Usage(40, None, 3)
    # Anthropic stream: message_start says nothing of the cache, message_delta does.
    split = {"input_tokens": 18, "cache_read_input_tokens": 0, "output_tokens": 9}
    stream = _event(
        {"type": "message_start", "message": {"usage": {"input_tokens": 18, "output_tokens": 0}}}
    ) + _event({"type": "message_delta", "usage": split})
    assert _scan([stream], drop=True)[1] == Usage(18, 0, 9)


def test_a_cut_stream_is_billed_for_what_it_delivered() -> None:
    """The drain's record of a stream it ended: the output counted from the events relayed
    (the opening events aside), the prompt as the replica reported it or else estimated."""
    chat = SseUsageScanner(drop_usage_event=True)
    role = _event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    token = _event({"choices": [{"index": 0, "delta": {"content": "x"}}]})
    chat.feed(role + token * 5 + token[:7])  # an event not yet complete is not delivered
    assert delivered_usage("/v1/chat/completions", chat, 120) == Usage(120, None, 5)
    completions = SseUsageScanner(drop_usage_event=True)
    completions.feed(STREAM[:40])
    assert delivered_usage("/v1/completions", completions, 9) == Usage(9, None, 0)
    messages = SseUsageScanner(drop_usage_event=False)
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 42}}}
    messages.feed(
        _event(start)
        + _event({"type": "content_block_start"})  # and no ping: vLLM sends none
        + _event({"type": "content_block_delta", "delta": {"text": "y"}}) * 3
    )
    used = delivered_usage("/v1/messages", messages, 500)
    assert (used.prompt_tokens, used.completion_tokens) == (42, 3)  # the replica's prompt
