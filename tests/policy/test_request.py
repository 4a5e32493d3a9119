"""Routes, inspection and the forwarded body."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from saltgate.policy.errors import ApiError
from saltgate.policy.request import (
    ALLOWED_POST_ROUTES,
    SALTED_ROUTES,
    STRIPPED_FIELDS,
    Inspected,
    inspect,
    parse_body,
    prepare,
    resolve_route,
)

pytestmark = pytest.mark.unit

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SALT = "sg1_" + "A" * 43
CAP = 1 << 20
# Whether each forwarded route must carry the gateway's salt: every route vLLM's prefix
# cache serves (docs/conformance.md), pinned here apart from the code's own list, so a
# route dropped from it, or added to the forwarded ones without it, fails.
SALTED: dict[str, bool] = {
    "/v1/chat/completions": True,
    "/v1/completions": True,
    "/v1/responses": True,
    "/v1/messages": True,
    "/v1/embeddings": True,
    "/pooling": True,
    "/classify": True,
    "/score": True,
    "/v1/score": True,
    "/rerank": True,
    "/v1/rerank": True,
    "/v2/rerank": True,
    "/tokenize": False,
    "/detokenize": False,
    "/v1/messages/count_tokens": False,
}


# -- routes -------------------------------------------------------------------------------


@pytest.mark.parametrize("route", sorted(ALLOWED_POST_ROUTES))
def test_allowed_post_routes(route: str) -> None:
    assert resolve_route(b"POST", route.encode()) == route
    assert resolve_route("POST", route + "?x=1") == route


def test_local_get_routes() -> None:
    assert resolve_route(b"GET", b"/v1/models") == "/v1/models"
    assert resolve_route(b"GET", b"/health") == "/health"


@pytest.mark.parametrize(
    "path",
    [
        b"/invocations",
        b"/v1/responses/resp_123",
        b"/admin/secrets",
        b"/v1/chat/completions/",
        b"//v1/chat/completions",
        b"/v1/chat%2Fcompletions",
        b"/V1/completions",
        b"/metrics",
        b"/v1/load_lora_adapter",
        b"/" + b"a" * 5000,
    ],
)
def test_unknown_paths_are_404(path: bytes) -> None:
    with pytest.raises(ApiError) as info:
        resolve_route(b"POST", path)
    assert info.value.status == 404 and info.value.type == "not_found_error"
    assert "/v1/chat/completions" in info.value.message  # says what is supported
    assert len(info.value.message) < 500


def test_the_salted_routes_are_the_pinned_ones() -> None:
    assert {route: route in SALTED_ROUTES for route in ALLOWED_POST_ROUTES} == SALTED


def test_every_route_vllm_serves_is_forwarded_or_closed_with_a_reason() -> None:
    for route in ALLOWED_POST_ROUTES:
        assert resolve_route(b"POST", route.encode()) == route
    for path in (b"/v1/audio/transcriptions", b"/v1/audio/translations"):
        with pytest.raises(ApiError) as info:
            resolve_route(b"POST", path)
        assert (info.value.status, info.value.code) == (404, "route_closed")
        assert "multipart" in info.value.message


@pytest.mark.parametrize("route", sorted(ALLOWED_POST_ROUTES))
def test_a_client_salt_never_survives_and_cache_routes_get_the_derived_one(route: str) -> None:
    body = {"model": "m", "input": "x", "prompt": "x", "cache_salt": "victim-salt"}
    raw = sent(route, body)
    assert b"victim-salt" not in raw  # not even as a duplicate key, which a parse would hide
    assert orjson.loads(raw).get("cache_salt") == (SALT if SALTED[route] else None)
    # Positive control: the same scan of what the policy forwards finds the client's
    # value where the policy keeps it.
    assert b"victim-salt" in sent(route, body | {"prompt": "victim-salt", "input": "victim-salt"})


def test_the_tokenizer_routes_need_no_model() -> None:
    assert inspect("/tokenize", {"prompt": "x"}).model == ""
    with pytest.raises(ApiError):
        inspect("/v1/embeddings", {"input": "x"})


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        (b"GET", b"/v1/completions", b"POST"),
        (b"DELETE", b"/v1/completions", b"POST"),
        (b"POST", b"/v1/models", b"GET"),
        (b"PUT", b"/health", b"GET"),
    ],
)
def test_wrong_method_is_405_with_allow(method: bytes, path: bytes, allow: bytes) -> None:
    with pytest.raises(ApiError) as info:
        resolve_route(method, path)
    assert info.value.status == 405
    assert (b"allow", allow) in info.value.headers


def test_routes_can_be_narrowed() -> None:
    narrowed = ALLOWED_POST_ROUTES - {"/v1/messages"}
    with pytest.raises(ApiError) as info:
        resolve_route(b"POST", b"/v1/messages", narrowed)
    assert info.value.status == 404


# -- inspect ------------------------------------------------------------------------------


def test_inspect_reads_the_fields() -> None:
    got = inspect(CHAT, {"model": "m", "stream": True, "max_tokens": 5, "prompt_cache_key": "k"})
    assert got == Inspected(
        route=CHAT,
        model="m",
        stream=True,
        client_wants_usage=False,
        user_cache_secret=None,
        max_tokens=5,
        prompt_cache_key="k",
    )
    assert got.forces_usage


@pytest.mark.parametrize(
    ("route", "body", "wants"),
    [
        (CHAT, {"stream": False}, True),
        (CHAT, {}, True),
        (CHAT, {"stream": True}, False),
        (CHAT, {"stream": True, "stream_options": None}, False),
        (CHAT, {"stream": True, "stream_options": {}}, False),
        (CHAT, {"stream": True, "stream_options": {"include_usage": False}}, False),
        (CHAT, {"stream": True, "stream_options": {"include_usage": True}}, True),
        (COMPLETIONS, {"stream": True}, False),
        ("/v1/responses", {"stream": True}, True),
        ("/v1/messages", {"stream": True}, True),
    ],
)
def test_client_wants_usage(route: str, body: dict[str, Any], wants: bool) -> None:
    assert inspect(route, {"model": "m", **body}).client_wants_usage is wants


def test_secret_is_validated_and_hidden_from_repr() -> None:
    secret = "s" * 32
    got = inspect(CHAT, {"model": "m", "user_cache_secret": secret})
    assert got.user_cache_secret == secret
    assert secret not in repr(got)
    assert inspect(CHAT, {"model": "m", "user_cache_secret": ""}).user_cache_secret is None
    for bad in (7, "short-secret-15", "x" * 257):
        with pytest.raises(ApiError) as info:
            inspect(CHAT, {"model": "m", "user_cache_secret": bad})
        err = info.value
        assert (err.status, err.type) == (400, "invalid_request_error")
        assert (err.param, err.code) == ("user_cache_secret", "invalid_user_cache_secret")
        assert "16 to 256 characters" in err.message
        assert not isinstance(bad, str) or bad not in err.body().decode()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "model"),
        ({"model": None}, "model"),
        ({"model": 123}, "model"),
        ({"model": ""}, "model"),
        ({"model": ["m"]}, "model"),
        ({"model": "m", "stream": "yes"}, "stream"),
        ({"model": "m", "stream": 1}, "stream"),
        ({"model": "m", "stream_options": "x"}, "stream_options"),
        ({"model": "m", "stream_options": []}, "stream_options"),
        ({"model": "m", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"model": "m", "max_tokens": -1}, "max_tokens"),
        ({"model": "m", "max_tokens": 1.5}, "max_tokens"),
        ({"model": "m", "max_tokens": True}, "max_tokens"),
        ({"model": "m", "max_tokens": "10"}, "max_tokens"),
        ({"model": "m", "max_completion_tokens": -3}, "max_completion_tokens"),
        ({"model": "m", "max_output_tokens": 2.0}, "max_output_tokens"),
        ({"model": "m", "prompt_cache_key": 5}, "prompt_cache_key"),
    ],
)
def test_wrong_types_are_400_naming_the_parameter(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        inspect(CHAT, body)
    assert info.value.status == 400
    assert info.value.param == param
    assert param in info.value.message


def test_max_tokens_zero_and_nulls_are_accepted() -> None:
    assert inspect(CHAT, {"model": "m", "max_tokens": 0}).max_tokens == 0
    got = inspect(CHAT, {"model": "m", "max_tokens": None, "max_completion_tokens": 9})
    assert got.max_tokens == 9


# -- prepare ------------------------------------------------------------------------------


def sent(route: str, body: dict[str, Any], salt: str | None = SALT) -> bytes:
    """The bytes `prepare` forwards for ``body`` (parsed as the gateway parses it)."""
    return prepare(parse_body(orjson.dumps(body), CAP), inspect(route, body), salt)


def forwarded(route: str, body: dict[str, Any], salt: str | None = SALT) -> dict[str, Any]:
    out: dict[str, Any] = orjson.loads(sent(route, body, salt))
    return out


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT, "/v1/embeddings", "/tokenize"])
@pytest.mark.parametrize("stream", [False, True])
def test_the_spliced_body_is_what_serialising_the_edited_object_writes(
    route: str, stream: bool
) -> None:
    """The fast path splices the salt into the parse's serialisation; byte for byte it
    must be what editing the object and serialising it would give, for any body."""
    rng = random.Random(7)
    for _ in range(200):
        body: dict[str, Any] = {"model": "m", "prompt": "x", "stream": stream}
        for i in range(rng.randrange(6)):
            body[f"k{rng.randrange(99)}é{i}"] = rng.choice(
                [1, -2.5, 'a"b\u00e9\n', None, True, [1, {"x": "}"}], {"y": [2, "]"]}]
            )
        if rng.random() < 0.3:
            body[rng.choice(sorted(STRIPPED_FIELDS))] = "smuggled-" + "x" * 16
        inspected = inspect(route, body)
        edited = {k: v for k, v in body.items() if k not in STRIPPED_FIELDS}
        if SALTED[route]:
            edited["cache_salt"] = SALT
        if inspected.forces_usage:
            edited["stream_options"] = {"include_usage": True}
        assert sent(route, body) == orjson.dumps(edited)


def test_prepare_strips_and_sets_the_salt() -> None:
    body = {
        "model": "m",
        "prompt": "P",
        "cache_salt": "victim-salt",
        "user_cache_secret": "s" * 20,
        "vllm_xargs": {"kv_cache_report_mode": "all"},
        "kv_transfer_params": {"remote_block_ids": [1]},
        "request_id": "another-tenants-request",
        "priority": -1000,
        "session_id": "another-tenants-session",
        "temperature": 0.5,
    }
    out = forwarded(COMPLETIONS, body)
    assert out == {"model": "m", "prompt": "P", "temperature": 0.5, "cache_salt": SALT}
    assert body["cache_salt"] == "victim-salt"  # the input is not modified
    expected = {
        "cache_salt",
        "user_cache_secret",
        "vllm_xargs",
        "kv_transfer_params",
        "ec_transfer_params",
        "request_id",
        "priority",
        "session_id",
    }
    assert expected == STRIPPED_FIELDS


@pytest.mark.parametrize("client_salt", [12345, None, {"nested": "victim"}, ""])
def test_any_client_salt_is_replaced(client_salt: object) -> None:
    out = forwarded(COMPLETIONS, {"model": "m", "prompt": "P", "cache_salt": client_salt})
    assert out["cache_salt"] == SALT


def test_salting_disabled_leaves_no_salt() -> None:
    out = forwarded(COMPLETIONS, {"model": "m", "prompt": "P", "cache_salt": "c"}, salt=None)
    assert "cache_salt" not in out


def test_usage_is_forced_on_streams_and_recorded() -> None:
    body = {"model": "m", "stream": True, "stream_options": {"continuous_usage_stats": True}}
    insp = inspect(CHAT, body)
    out = forwarded(CHAT, body)
    # usage on every chunk could not be removed again, so it is not asked for
    assert out["stream_options"] == {"include_usage": True}
    assert insp.client_wants_usage is False
    assert body["stream_options"] == {"continuous_usage_stats": True}
    both = {**body, "stream_options": {"continuous_usage_stats": True, "include_usage": True}}
    out = forwarded(CHAT, both)
    assert out["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    plain = forwarded(COMPLETIONS, {"model": "m", "stream": True})
    assert plain["stream_options"] == {"include_usage": True}


def test_usage_is_not_touched_without_a_stream_or_on_other_routes() -> None:
    assert "stream_options" not in forwarded(CHAT, {"model": "m"})
    assert "stream_options" not in forwarded("/v1/responses", {"model": "m", "stream": True})
    assert "stream_options" not in forwarded("/v1/messages", {"model": "m", "stream": True})


def test_prepare_preserves_big_ints_and_unicode() -> None:
    body = {"model": "m", "seed": 2**64 - 1, "prompt": "é😀\u2028", "logit_bias": {"5": -100}}
    out = forwarded(COMPLETIONS, body)
    assert out["seed"] == 2**64 - 1 and out["prompt"] == "é😀\u2028"
