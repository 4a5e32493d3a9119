"""The probe design, request bodies, stream reading and presets (no sockets)."""

from __future__ import annotations

import random
from collections import Counter

import orjson
import pytest

from saltgate.audit.plan import (
    Identity,
    ProbeError,
    StreamReader,
    TimingAuditConfig,
    apply_preset,
    error_message,
    render_prompt,
    request_body,
    schedule,
    trial_prompts,
)

pytestmark = pytest.mark.unit

VOCAB = range(16, 1000)


def test_schedule_is_balanced_and_shuffled() -> None:
    trials = schedule(random.Random(1), [(0, "attack", 50), (0, "control", 10), (1, "attack", 5)])
    cells = Counter((t.configuration, t.role, t.arm) for t in trials)
    assert cells == {
        (0, "attack", "hit"): 50,
        (0, "attack", "miss"): 50,
        (0, "control", "hit"): 10,
        (0, "control", "miss"): 10,
        (1, "attack", "hit"): 5,
        (1, "attack", "miss"): 5,
    }
    arms = [t.arm for t in trials if t.configuration == 0 and t.role == "attack"]
    assert 10 < arms[:50].count("hit") < 40  # interleaved in time, not one arm then the other
    assert {t.role for t in trials[:30]} == {"attack", "control"}


def test_hit_prompts_share_exactly_the_prefix_and_misses_share_nothing() -> None:
    rng = random.Random(5)
    for _ in range(200):
        hit = trial_prompts(rng, 16, 4, "hit", VOCAB)
        assert len(hit.victim) == len(hit.probe) == 20
        assert hit.probe[:16] == hit.victim[:16]
        assert hit.probe[16] != hit.victim[16]
        miss = trial_prompts(rng, 16, 4, "miss", VOCAB)
        assert len(miss.probe) == 20
        assert miss.probe[0] != miss.victim[0]
        assert all(u in VOCAB for u in miss.probe + hit.probe)
    with pytest.raises(ValueError, match="at least one unit"):
        trial_prompts(rng, 16, 0, "hit", VOCAB)


def test_text_prompts_are_one_letter_per_unit() -> None:
    assert render_prompt([0, 1, 25, 26], "text") == "a b z a"
    assert render_prompt([17, 18], "tokens") == [17, 18]


def test_request_body_carries_the_identity_fields_and_streams_with_usage() -> None:
    body = orjson.loads(
        request_body("completions", "m", [17, 18], Identity("k", "s" * 16, "salt"), 1)
    )
    assert body["prompt"] == [17, 18] and body["model"] == "m" and body["max_tokens"] == 1
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["user_cache_secret"] == "s" * 16 and body["cache_salt"] == "salt"
    plain = orjson.loads(request_body("chat", "m", "a b", Identity(), 1))
    assert plain["messages"] == [{"role": "user", "content": "a b"}]
    assert "user_cache_secret" not in plain and "cache_salt" not in plain
    with pytest.raises(ValueError, match="text"):
        request_body("chat", "m", [1], Identity(), 1)


def test_identity_never_shows_its_secrets() -> None:
    ident = Identity("sk-live-key", "a-user-secret-123", "raw-salt")
    for text in (repr(ident), str(ident)):
        assert "sk-live-key" not in text and "a-user-secret-123" not in text
        assert "raw-salt" not in text
    assert ident.describe() == {"api_key": True, "user_cache_secret": True, "cache_salt": True}
    assert ident.headers() == {"authorization": "Bearer sk-live-key"}


def chunk(obj: object) -> str:
    return "data: " + orjson.dumps(obj).decode()


def test_stream_reader_marks_the_first_content_chunk() -> None:
    chat = StreamReader()
    assert not chat.feed(chunk({"choices": [{"delta": {"role": "assistant", "content": ""}}]}))
    assert not chat.feed("")
    assert chat.feed(chunk({"choices": [{"delta": {"content": "hi"}}]}))
    assert not chat.feed(chunk({"choices": [{"delta": {"content": "again"}}]}))
    chat.feed(chunk({"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 32}}}))
    chat.feed("data: [DONE]")
    assert chat.cached_tokens == 32 and chat.done
    completion = StreamReader()
    assert completion.feed(chunk({"choices": [{"text": "x", "index": 0}]}))
    # a token can decode to "" (real vLLM with a random model): it is still the first token
    empty = StreamReader()
    assert empty.feed(chunk({"choices": [{"text": "", "index": 0, "finish_reason": None}]}))
    empty_chat = StreamReader()
    assert empty_chat.feed(chunk({"choices": [{"delta": {"content": ""}}]}))


def test_stream_reader_reports_errors_and_garbage() -> None:
    with pytest.raises(ProbeError, match="replica failed"):
        StreamReader().feed(chunk({"error": {"message": "The replica failed\nline two"}}))
    with pytest.raises(ProbeError, match="not JSON"):
        StreamReader().feed("data: {oops")
    assert error_message(b'{"error": {"message": "Invalid API key."}}') == "Invalid API key."
    assert error_message(b'{"error": "Unauthorized"}') == "Unauthorized"
    assert error_message(b"<html>bad gateway") == "<html>bad gateway"


def test_presets_pick_the_attacker_model() -> None:
    victim = Identity("victim-key", "victim-secret-16chars")
    other = Identity("other-key")
    assert apply_preset("other-tenant", victim, other) == other
    operator = apply_preset("operator", victim, Identity())
    assert operator.api_key == "victim-key" and operator.user_cache_secret is None
    assert apply_preset("same-tenant", victim, other) == victim
    assert apply_preset(None, victim, other) == other
    for preset, attacker, message in (
        ("other-tenant", Identity(), "--attacker-key is required"),
        ("other-tenant", Identity("victim-key"), "must differ"),
        ("operator", Identity("other-key"), "drop --attacker-key"),
        ("operator", Identity(None, "victim-secret-16chars"), "does not know"),
    ):
        with pytest.raises(ValueError, match=message):
            apply_preset(preset, victim, attacker)
    with pytest.raises(ValueError, match="--victim-secret is required"):
        apply_preset("operator", Identity("victim-key"), Identity())
    with pytest.raises(ValueError, match="--victim-key is required"):
        apply_preset("same-tenant", Identity(), Identity())


def test_config_refuses_impossible_settings() -> None:
    for kwargs, message in (
        ({"samples": 300, "max_samples": 200}, "samples <= max_samples"),
        ({"prefix_tokens": ()}, "prefix_tokens"),
        ({"route": "chat"}, "text"),
        ({"tail_tokens": 0}, "tail_tokens"),
    ):
        with pytest.raises(ValueError, match=message):
            TimingAuditConfig("http://x", Identity(), Identity(), **kwargs)
