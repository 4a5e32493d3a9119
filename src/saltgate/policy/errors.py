"""Errors in OpenAI's JSON shape, raised by the pure request path and rendered by the edge.

Messages tell the caller what to fix. They never contain secret values (API keys,
user_cache_secret, salts): callers pass parameter names, not the values.
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson

from saltgate.derivations.derive import ROUTE_MESSAGES, ROUTE_RESPONSES

_DEFAULT_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def default_type(status: int) -> str:
    """OpenAI's error type for a status (``server_error`` for other 5xx)."""
    if status in _DEFAULT_TYPES:
        return _DEFAULT_TYPES[status]
    return "server_error" if status >= 500 else "invalid_request_error"


class ApiError(Exception):
    """An HTTP error answer: status, OpenAI error fields and optional extra headers.

    ``headers`` carries what the status needs (e.g. ``Allow`` on a 405); names are
    lower-case bytes like everything else the edge handles.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type if type is not None else default_type(status)
        self.param = param
        self.code = code
        self.headers: tuple[tuple[bytes, bytes], ...] = tuple(headers)

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, type={self.type!r}, code={self.code!r})"

    def to_dict(self) -> dict[str, dict[str, str | None]]:
        """The ``{"error": {...}}`` document."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def body(self) -> bytes:
        """The JSON response body in OpenAI's shape."""
        return orjson.dumps(self.to_dict())


class AnthropicApiError(ApiError):
    """An error on Anthropic's routes (/v1/messages), in Anthropic's shape
    ``{"type": "error", "error": {"type", "message"}}``, which its clients parse."""

    def body(self) -> bytes:
        error = {"type": self.type, "message": self.message}
        return orjson.dumps({"type": "error", "error": error})


# -- constructors for the common cases ---------------------------------------------------


def invalid_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    """400: the body or a parameter is wrong; ``param`` names it."""
    return ApiError(400, message, param=param, code=code)


def invalid_type(param: str, expected: str) -> ApiError:
    """400 for a parameter of the wrong JSON type (the value itself is not echoed)."""
    return ApiError(
        400,
        f"Invalid type for '{param}': expected {expected}.",
        param=param,
        code="invalid_type",
    )


def missing_parameter(param: str, expected: str) -> ApiError:
    """400 for a required parameter that is absent."""
    return ApiError(
        400,
        f"Missing required parameter '{param}': send {expected}.",
        param=param,
        code="missing_required_parameter",
    )


def invalid_user_cache_secret(message: str) -> ApiError:
    """400 for a ``user_cache_secret`` outside spec v1's rule (spec.InvalidSecretError)."""
    return ApiError(400, message, param="user_cache_secret", code="invalid_user_cache_secret")


def body_too_large(limit: int) -> ApiError:
    """413: the body exceeds the configured cap."""
    return ApiError(
        413,
        f"Request body too large: the limit is {limit} bytes.",
        code="request_too_large",
    )


def unauthorized(
    message: str = "Invalid or missing API key.", *, code: str | None = None
) -> ApiError:
    """401 (the key itself is never echoed)."""
    return ApiError(401, message, type="authentication_error", code=code or "invalid_api_key")


def not_found(path: str) -> ApiError:
    """404 for a path outside the allow-list."""
    return ApiError(
        404,
        f"Unknown endpoint {path!r}. Supported: POST /v1/chat/completions, /v1/completions, "
        "/v1/responses, /v1/messages, /v1/messages/count_tokens, /v1/embeddings, /pooling, "
        "/classify, /score, /v1/score, /rerank, /v1/rerank, /v2/rerank, /tokenize, "
        "/detokenize; GET /v1/models.",
        code="unknown_url",
    )


def route_closed(path: str, why: str) -> ApiError:
    """404 for a route vLLM serves that this gateway keeps closed, saying why."""
    return ApiError(
        404, f"POST {path} is not served through this gateway: {why}.", code="route_closed"
    )


def method_not_allowed(method: str, path: str, allowed: Sequence[str]) -> ApiError:
    """405 with an ``Allow`` header listing what the path accepts."""
    allow = ", ".join(allowed)
    return ApiError(
        405,
        f"Method {method} is not allowed on {path}; use {allow}.",
        code="method_not_allowed",
        headers=((b"allow", allow.encode("ascii")),),
    )


def model_not_found(model: str, *, anthropic: bool = False) -> ApiError:
    """404 for a model no replica serves, or one outside the tenant's allowed models: the
    same answer, so a tenant cannot tell the models it may not use from those not served."""
    shown = model if len(model) <= _MAX_MODEL_ECHO else model[:_MAX_MODEL_ECHO] + "..."
    message = f"The model `{shown}` does not exist or you do not have access to it."
    if anthropic:
        return AnthropicApiError(404, message, type="not_found_error")
    return ApiError(
        404, message, type="invalid_request_error", param="model", code="model_not_found"
    )


_MAX_MODEL_ECHO = 120


def gateway_stopping() -> ApiError:
    """A stream cut short because the gateway is shutting down (its drain grace ran out)."""
    return ApiError(
        503,
        "The gateway is shutting down and ended this answer early; retry the request.",
        code="gateway_stopping",
    )


def gateway_draining(*, anthropic: bool) -> ApiError:
    """503 for a request that reaches a gateway after SIGTERM, on a connection already open
    (its listener is closed): it finishes what it has and takes nothing new; another
    gateway serves the retry (the SDKs retry a 503)."""
    message = "The gateway is shutting down; retry the request."
    if anthropic:
        return AnthropicApiError(503, message, type="api_error")
    return ApiError(503, message, code="gateway_stopping")


def stream_error_event(route: str, error: ApiError) -> bytes:
    """``error`` as the last event of a stream on ``route``, in the shape that route's
    clients parse: Anthropic's ``event: error``, the Responses API's ``error`` event, and
    on the OpenAI completions routes the ``data: {"error": ...}`` that vLLM sends when a
    stream fails (the openai SDK raises it as an APIError)."""
    if route == ROUTE_MESSAGES:
        inner = {"type": "api_error", "message": error.message}
        return b"event: error\ndata: " + orjson.dumps({"type": "error", "error": inner}) + b"\n\n"
    if route == ROUTE_RESPONSES:
        event = {"type": "error", "code": error.code or error.type, "message": error.message}
        return b"event: error\ndata: " + orjson.dumps({**event, "param": error.param}) + b"\n\n"
    return b"data: " + error.body() + b"\n\n"
