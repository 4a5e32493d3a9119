"""Header allow-lists and the OpenAI error shape."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest
from anthropic._streaming import SSEDecoder as AnthropicDecoder
from openai._streaming import SSEDecoder as OpenAIDecoder

from saltgate.policy.errors import (
    ApiError,
    body_too_large,
    gateway_draining,
    gateway_stopping,
    invalid_type,
    method_not_allowed,
    missing_parameter,
    not_found,
    stream_error_event,
    unauthorized,
)
from saltgate.policy.headers import credential, forward_request_headers, scrub_response_headers

pytestmark = pytest.mark.unit


def test_forwarded_request_headers_are_an_allow_list() -> None:
    incoming = [
        (b"host", b"gw.example"),
        (b"authorization", b"Bearer sg_tenant_key"),
        (b"content-type", b"text/plain"),
        (b"content-length", b"99"),
        (b"accept", b"text/event-stream"),
        (b"accept-encoding", b"gzip, br"),
        (b"user-agent", b"OpenAI/Python 1.50"),
        (b"x-tenant-id", b"victim"),
        (b"x-request-id", b"chosen-id"),
        (b"openai-beta", b"assistants=v2"),
        (b"anthropic-version", b"2023-06-01"),
        (b"anthropic-beta", b"a"),
        (b"anthropic-beta", b"b"),
        (b"cookie", b"s=1"),
        (b"x-stainless-os", b"Linux"),
        (b"traceparent", b"00-abc-def-01"),
        (b"transfer-encoding", b"chunked"),
        (b"ehbp-encapsulated-key", b"00"),
    ]
    assert forward_request_headers(incoming, "gw-id") == [
        (b"content-type", b"application/json"),
        (b"x-request-id", b"gw-id"),
        (b"accept", b"text/event-stream"),
        (b"user-agent", b"OpenAI/Python 1.50"),
        (b"openai-beta", b"assistants=v2"),
        (b"anthropic-version", b"2023-06-01"),
        (b"anthropic-beta", b"a"),
        (b"anthropic-beta", b"b"),
    ]
    assert forward_request_headers([], "gw-id") == [
        (b"content-type", b"application/json"),
        (b"x-request-id", b"gw-id"),
    ]


PARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize(
    ("fields", "passed"),
    [
        ([(b"traceparent", PARENT)], [(b"traceparent", PARENT)]),
        (
            [(b"tracestate", b"congo=t61rcWkgMzE"), (b"traceparent", PARENT)],
            [(b"traceparent", PARENT), (b"tracestate", b"congo=t61rcWkgMzE")],
        ),
        ([(b"traceparent", PARENT + b"-more")], []),  # version 00 has exactly four fields
        ([(b"tracestate", b"congo=t61rcWkgMzE")], []),  # state without a parent
        ([(b"traceparent", b"00-abc-def-01")], []),
        ([(b"traceparent", PARENT.upper())], []),
        ([(b"traceparent", b"00-" + b"0" * 32 + b"-00f067aa0ba902b7-01")], []),
        ([(b"traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-" + b"0" * 16 + b"-01")], []),
        ([(b"traceparent", b"ff" + PARENT[2:])], []),
        ([(b"traceparent", PARENT), (b"traceparent", PARENT)], []),
        ([(b"traceparent", PARENT + b"\r\nx-tenant-id: victim")], []),
        (
            [(b"traceparent", PARENT), (b"tracestate", b"a=" + b"x" * 600)],
            [(b"traceparent", PARENT)],
        ),
    ],
)
def test_only_a_well_formed_trace_context_passes(
    fields: list[tuple[bytes, bytes]], passed: list[tuple[bytes, bytes]]
) -> None:
    assert forward_request_headers(fields, "id")[2:] == passed


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ([(b"authorization", b"Bearer sk-1")], b"sk-1"),
        ([(b"authorization", b"bearer  sk-1 ")], b"sk-1"),
        ([(b"x-api-key", b"sk-1")], b"sk-1"),
        ([(b"x-api-key", b"sk-1"), (b"authorization", b"Bearer sk-1")], b"sk-1"),
        ([(b"authorization", b"Basic c2stMQ==")], None),
        ([(b"authorization", b"Bearer")], None),
    ],
)
def test_a_key_comes_as_a_bearer_token_or_as_x_api_key(
    fields: list[tuple[bytes, bytes]], key: bytes | None
) -> None:
    assert credential(fields) == key


@pytest.mark.parametrize(
    ("fields", "status"),
    [
        ([], 401),
        ([(b"x-api-key", b"sk-1"), (b"authorization", b"Bearer sk-2")], 400),
        ([(b"authorization", b"Bearer sk-1"), (b"authorization", b"Bearer sk-1")], 400),
        ([(b"x-api-key", b"sk-1"), (b"x-api-key", b"sk-2")], 400),
    ],
)
def test_a_missing_or_ambiguous_key_is_refused_without_echoing_it(
    fields: list[tuple[bytes, bytes]], status: int
) -> None:
    with pytest.raises(ApiError) as info:
        credential(fields)
    assert info.value.status == status
    assert b"sk-" not in info.value.body()


def test_response_headers_reveal_nothing_of_the_replica() -> None:
    upstream = [
        (b"date", b"Sat, 29 Nov 2026 11:00:00 GMT"),
        (b"server", b"uvicorn"),
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"content-length", b"10"),
        (b"transfer-encoding", b"chunked"),
        (b"x-request-id", b"chatcmpl-replica-3"),
        (b"set-cookie", b"route=replica3"),
        (b"via", b"1.1 replica3"),
        (b"cache-control", b"no-cache"),
        (b"retry-after", b"2"),
        (b"connection", b"keep-alive"),
    ]
    assert scrub_response_headers(upstream) == [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-cache"),
        (b"retry-after", b"2"),
    ]


def test_error_body_has_openais_shape() -> None:
    err = ApiError(400, "Fix it.", param="model", code="invalid_value")
    assert orjson.loads(err.body()) == {
        "error": {
            "message": "Fix it.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "invalid_value",
        }
    }
    assert str(err) == "Fix it."


def test_default_types_follow_the_status() -> None:
    assert ApiError(401, "x").type == "authentication_error"
    assert ApiError(404, "x").type == "not_found_error"
    assert ApiError(429, "x").type == "rate_limit_error"
    assert ApiError(502, "x").type == "server_error"
    assert ApiError(503, "x", type="service_unavailable").type == "service_unavailable"


def test_constructors() -> None:
    assert body_too_large(1000).status == 413
    assert unauthorized().status == 401 and unauthorized().type == "authentication_error"
    assert not_found("/x").status == 404
    e = method_not_allowed("GET", "/v1/completions", ["POST"])
    assert e.status == 405 and e.headers == ((b"allow", b"POST"),)
    t = invalid_type("stream", "a boolean")
    assert t.param == "stream" and "stream" in t.message and "boolean" in t.message
    m = missing_parameter("model", "a string")
    assert m.code == "missing_required_parameter" and "model" in m.message


@pytest.mark.parametrize(
    ("route", "event", "message_of"),
    [
        ("/v1/chat/completions", None, lambda doc: doc["error"]["message"]),
        ("/v1/completions", None, lambda doc: doc["error"]["message"]),
        ("/v1/messages", "error", lambda doc: doc["error"]["message"]),
        ("/v1/responses", "error", lambda doc: doc["message"]),
    ],
)
def test_a_stream_error_event_has_its_routes_shape(
    route: str, event: str | None, message_of: Callable[[dict[str, Any]], str]
) -> None:
    """As each route's SDK decodes it (the openai and anthropic SSE decoders): OpenAI's
    completions routes a data-only `{"error": ...}` (the SDK raises it), Anthropic's and
    the Responses API's an `error` event."""
    error = gateway_stopping()
    raw = stream_error_event(route, error)
    if route == "/v1/messages":
        [(name, data)] = [(e.event, e.data) for e in AnthropicDecoder().iter_bytes(iter([raw]))]
    else:
        [(name, data)] = [(e.event, e.data) for e in OpenAIDecoder().iter_bytes(iter([raw]))]
    assert name == event
    doc = orjson.loads(data)
    assert message_of(doc) == error.message
    if route == "/v1/responses":
        assert doc["type"] == "error" and doc["code"] == "gateway_stopping"
    elif route == "/v1/messages":
        assert doc["type"] == "error" and doc["error"]["type"] == "api_error"
    else:
        assert doc["error"]["code"] == "gateway_stopping" and doc["error"]["type"] == (
            "service_unavailable"
        )


def test_a_request_during_the_drain_gets_a_retryable_503_in_its_apis_shape() -> None:
    openai = gateway_draining(anthropic=False)
    assert (openai.status, openai.code, openai.type) == (
        503,
        "gateway_stopping",
        "service_unavailable",
    )
    anthropic = orjson.loads(gateway_draining(anthropic=True).body())
    assert gateway_draining(anthropic=True).status == 503
    assert anthropic == {
        "type": "error",
        "error": {
            "type": "api_error",
            "message": "The gateway is shutting down; retry the request.",
        },
    }
