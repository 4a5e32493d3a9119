"""Issue 40, "Fields": request fields that reach shared engine state, and answer members
that expose it (saltgate/policy/fields.py, wired in policy/request.py)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from tests.support.adversarial_fields import (
    ANSWER_FIELDS_SEEN,
    raw_duplicates,
    refused_cases,
    stripped_cases,
)

from saltgate.policy import fields
from saltgate.policy.errors import ApiError
from saltgate.policy.request import inspect, parse_body, prepare

pytestmark = pytest.mark.unit

CHAT = "/v1/chat/completions"


def _forwarded(route: str, body: dict[str, Any]) -> dict[str, Any]:
    parsed = parse_body(orjson.dumps(body), 1 << 20)
    out: dict[str, Any] = orjson.loads(prepare(parsed, inspect(route, parsed.obj), "salt"))
    return out


@pytest.mark.parametrize("case", list(stripped_cases()), ids=lambda c: c.name)
def test_stripped_fields_never_forwarded(case: Any) -> None:
    out = _forwarded(case.route, case.body)
    assert not case.leaked(out), out


@pytest.mark.parametrize("case", list(refused_cases()), ids=lambda c: c.name)
def test_refused_fields_are_a_400_naming_the_param(case: Any) -> None:
    with pytest.raises(ApiError) as info:
        inspect(case.route, case.body)
    assert info.value.status == 400
    assert info.value.param == case.param, info.value


@pytest.mark.parametrize("name", ["n", "best_of"])
def test_sequences_at_the_cap_pass(name: str) -> None:
    body = {"model": "m", "prompt": "x", name: fields.MAX_SEQUENCES}
    assert _forwarded("/v1/completions", body)[name] == fields.MAX_SEQUENCES


def test_function_tools_pass() -> None:
    tool = {"type": "function", "name": "f", "parameters": {}}
    body = {"model": "m", "input": "x", "tools": [tool]}
    assert _forwarded("/v1/responses", body)["tools"] == [tool]


@pytest.mark.parametrize("answer", ANSWER_FIELDS_SEEN, ids=range(len(ANSWER_FIELDS_SEEN)))
def test_answer_fields_dropped(answer: dict[str, Any]) -> None:
    out = fields.scrub_answer(orjson.dumps(answer))
    for name in fields.ANSWER_FIELDS:
        assert f'"{name}"'.encode() not in out
    assert orjson.loads(out)["id"] == answer["id"]  # the rest is kept


@pytest.mark.parametrize("answer", ANSWER_FIELDS_SEEN, ids=range(len(ANSWER_FIELDS_SEEN)))
def test_answer_fields_dropped_from_every_event(answer: dict[str, Any]) -> None:
    event = b"data: " + orjson.dumps(answer) + b"\n\n"
    out = fields.scrub_events(b"event: x\n" + event + event + b"data: [DONE]\n\n")
    assert out.count(b"\n\n") == 3 and out.endswith(b"data: [DONE]\n\n")
    for name in fields.ANSWER_FIELDS:
        assert f'"{name}"'.encode() not in out


def test_answers_without_markers_are_the_same_object() -> None:
    body = b'{"id":"x","choices":[{"text":"metrics"}]}'
    assert fields.scrub_answer(body) is body
    assert fields.scrub_events(b"data: " + body + b"\n\n") == b"data: " + body + b"\n\n"


def test_a_member_named_like_a_field_deeper_in_is_kept() -> None:
    # Responses echo the request's JSON schema: a property called "metrics" is content.
    body = orjson.dumps({"id": "r", "text": {"format": {"schema": {"metrics": {}}}}})
    assert fields.scrub_answer(body) == body


@pytest.mark.parametrize("raw", [raw for _, raw in raw_duplicates()])
def test_a_duplicated_field_is_refused_at_parse(raw: bytes) -> None:
    with pytest.raises(ApiError) as info:
        parse_body(raw, 1 << 20)
    assert info.value.code == "duplicate_key"


@pytest.mark.parametrize("salt", ["salt", None])
@pytest.mark.parametrize("band", ["interactive", "batch", "unknown"])
def test_the_gateway_sets_the_band_s_priority_over_the_client_s(
    band: str, salt: str | None
) -> None:
    for body in ({"model": "m", "prompt": "x"}, {"model": "m", "prompt": "x", "priority": -1000}):
        parsed = parse_body(orjson.dumps(body), 1 << 20)
        inspected = inspect("/v1/completions", parsed.obj)
        ranked = fields.band_priority(band)
        out = orjson.loads(prepare(parsed, inspected, salt, ranked))
        assert out["priority"] == {"interactive": 0, "batch": 1, "unknown": 1}[band]
        assert orjson.loads(prepare(parsed, inspected, salt)).get("priority") is None


def test_a_null_chat_template_is_absent_as_in_vllm() -> None:
    body: dict[str, Any] = {"model": "m", "prompt": "x", "chat_template": None}
    body["chat_template_kwargs"] = {"chat_template": None, "enable_thinking": False}
    assert _forwarded("/v1/completions", body)["chat_template_kwargs"]["enable_thinking"] is False
