"""Header allow-lists and the OpenAI error shape."""

from __future__ import annotations

import orjson

from saltgate.policy.errors import (
    ApiError,
    body_too_large,
    invalid_type,
    method_not_allowed,
    missing_parameter,
    not_found,
    unauthorized,
)
from saltgate.policy.headers import forward_request_headers, scrub_response_headers


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
    assert forward_request_headers(incoming) == [
        (b"content-type", b"application/json"),
        (b"accept", b"text/event-stream"),
        (b"user-agent", b"OpenAI/Python 1.50"),
        (b"openai-beta", b"assistants=v2"),
        (b"anthropic-version", b"2023-06-01"),
        (b"anthropic-beta", b"a"),
        (b"anthropic-beta", b"b"),
    ]
    assert forward_request_headers([]) == [(b"content-type", b"application/json")]


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
