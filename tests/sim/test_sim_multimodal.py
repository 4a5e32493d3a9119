"""The simulator's multimodal caches key items as vLLM does: uuid verbatim, else content."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from saltgate.sim.errors import SimError
from saltgate.sim.multimodal import MAX_FEATURES, MediaCache, features
from saltgate.sim.server import SimConfig, SimServer
from saltgate.sim.tokenizer import tokenize

pytestmark = pytest.mark.unit

CHAT = b"/v1/chat/completions"


def url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(*parts: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": list(parts)}]}


def image(data: bytes | None, uuid: str | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {
        "type": "image_url",
        "image_url": None if data is None else {"url": url(data)},
    }
    if uuid is not None:
        part["uuid"] = uuid
    return part


def text_of(body: dict[str, Any]) -> str:
    (part,) = body["messages"][0]["content"]
    assert part["type"] == "text"
    return str(part["text"])


def test_features_are_one_token_per_feature_and_grow_with_the_bytes() -> None:
    small, large = features(b"x" * 10), features(b"y" * 6400)
    assert len(tokenize(small)) == 8
    assert len(tokenize(large)) == 8 + 100
    assert len(tokenize(features(b"z" * 10**6))) == MAX_FEATURES
    assert features(b"a" * 10) != features(b"b" * 10)


def test_a_uuid_is_the_key_verbatim_whatever_the_media() -> None:
    cache = MediaCache()
    first = text_of(cache.resolve(CHAT, chat(image(b"A" * 500, uuid="u1"))))
    again = text_of(cache.resolve(CHAT, chat(image(b"B" * 10, uuid="u1"))))
    assert again == first  # B's bytes, A's features: vLLM's uuid semantics
    assert text_of(cache.resolve(CHAT, chat(image(None, uuid="u1")))) == first
    assert (cache.queries, cache.hits, cache.hits_by_key["u1"]) == (3, 2, 2)


def test_without_a_uuid_the_key_is_the_content() -> None:
    cache = MediaCache()
    cache.resolve(CHAT, chat(image(b"A" * 500)))
    cache.resolve(CHAT, chat(image(b"A" * 500)))
    cache.resolve(CHAT, chat(image(b"C" * 500)))
    assert (cache.queries, cache.hits) == (3, 1)
    assert cache.hits_by_key[cache.stored[0]] == 1


def test_a_uuid_only_miss_is_vllm_s_400() -> None:
    with pytest.raises(SimError) as info:
        MediaCache().resolve(CHAT, chat(image(None, uuid="nobody")))
    assert info.value.status == 400
    assert "Cache miss for image at index 0 but data is not provided." in str(info.value)


@pytest.mark.parametrize(
    "body",
    [
        chat({"type": "image_embeds", "image_embeds": "AAAA"}),
        {"prompt": "x", "prompt_embeds": "AAAA"},
    ],
)
def test_embeds_get_vllm_s_flag_error(body: dict[str, Any]) -> None:
    with pytest.raises(SimError, match="You must set `--enable-"):
        MediaCache().resolve(CHAT, body)


def test_anthropic_blocks_are_keyed_by_content_their_uuid_dropped() -> None:
    cache = MediaCache()
    data = base64.b64encode(b"A" * 300).decode()
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    body = {"messages": [{"role": "user", "content": [{**block, "uuid": "u"}]}]}
    cache.resolve(b"/v1/messages", body)
    cache.resolve(
        b"/v1/messages/count_tokens", {"messages": [{"role": "user", "content": [block]}]}
    )
    assert (cache.hits, cache.hits_by_key["u"]) == (1, 0)


def test_responses_parts_are_resolved() -> None:
    cache = MediaCache()
    item = {"role": "user", "content": [{"type": "input_image", "image_url": url(b"R" * 64)}]}
    out = cache.resolve(b"/v1/responses", {"input": [item, item]})
    assert out["input"][0]["content"][0]["text"].startswith("<image>")
    assert (cache.queries, cache.hits) == (2, 1)


def test_metrics_count_queries_and_hits_where_vllm_writes_them() -> None:
    server = SimServer(SimConfig(model="m"))
    server.media.resolve(CHAT, chat(image(b"A" * 64)))
    server.media.resolve(CHAT, chat(image(b"A" * 64)))
    text = server.metrics().decode()
    assert 'vllm:mm_cache_queries_total{engine="0",model_name="m"} 2.0' in text
    assert 'vllm:mm_cache_hits_total{engine="0",model_name="m"} 1.0' in text
    # vLLM registers them after the external prefix cache counters, before preemptions
    names = ("external_prefix_cache_hits", "mm_cache_queries", "mm_cache_hits", "num_preemptions")
    order = [text.index(f"# HELP vllm:{name}_total ") for name in names]
    assert order == sorted(order)


def test_the_simulator_fetches_nothing() -> None:
    part = {"type": "image_url", "image_url": {"url": "http://169.254.169.254/"}}
    with pytest.raises(SimError, match="data: URLs only"):
        MediaCache().resolve(CHAT, chat(part))
