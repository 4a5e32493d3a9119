"""Header policy: what crosses the gateway in each direction (allow-lists, never deny-lists).

Names arrive as lower-case bytes (httptools). Anything not listed is dropped, so a header
a backend might act on (``x-tenant-id`` as a salt source, ``x-request-id`` as the engine's
request id, ``accept-encoding``) cannot be smuggled through by a new spelling.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable
from typing import Final

from saltgate.policy.errors import ApiError

Headers = list[tuple[bytes, bytes]]

# The forwarded body is always the JSON orjson wrote, whatever the client declared.
JSON_CONTENT_TYPE: Final = (b"content-type", b"application/json")

# Request headers copied to the replica, and why each is safe and useful:
FORWARDED_REQUEST_HEADERS: Final[frozenset[bytes]] = frozenset(
    {
        # What the client can consume (application/json or text/event-stream); vLLM only
        # reads it to shape errors, it cannot change caching or routing.
        b"accept",
        # Visible to the operator at the edge anyway (EHBP does not hide headers); lets
        # replica logs tell SDKs apart when debugging.
        b"user-agent",
        # API-version negotiation headers: the body's meaning can depend on them.
        b"openai-beta",
        b"anthropic-version",
        b"anthropic-beta",
    }
)
# Deliberately NOT forwarded (non-exhaustive; the allow-list above is what decides):
#   authorization    - replaced by the replica's own key; a tenant key must not reach it
#   content-type     - replaced by JSON_CONTENT_TYPE (the body is re-serialised)
#   content-length, transfer-encoding, host, connection, te, upgrade - hop-by-hop / set
#                      by the forwarder for the body it actually sends
#   accept-encoding  - the gateway parses the SSE stream (usage, errors); it must get
#                      identity-encoded bytes
#   x-request-id     - replaced by the gateway's own request id (vLLM may use it as the
#                      engine's request id: a client's choice could collide with another's)
#   x-tenant-id, cookie, x-stainless-*, openai-organization, openai-project,
#   x-forwarded-*    - salt sources and client fingerprints
# Passed only when well-formed (W3C Trace Context), so traces cross the gateway:
TRACE_PARENT: Final = b"traceparent"
TRACE_STATE: Final = b"tracestate"
_TRACE_FIELDS: Final = frozenset({TRACE_PARENT, TRACE_STATE})
_CREDENTIAL_FIELDS: Final = frozenset({b"authorization", b"x-api-key"})
# version-trace_id-parent_id-flags in lower-case hex, as version 00 defines it (later
# versions may append fields: not passed until understood); all-zero ids are invalid.
_TRACE_PARENT: Final = re.compile(rb"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
_TRACE_STATE: Final = re.compile(rb"[ -~]{0,512}")  # printable ASCII, the spec's size limit


def forward_request_headers(headers: Iterable[tuple[bytes, bytes]], request_id: str) -> Headers:
    """The headers to send upstream: content-type fixed to JSON, the gateway's request id,
    the allow-listed ones, and a well-formed trace context.

    Host, content-length and authorization are added by the forwarder.
    """
    out: Headers = [JSON_CONTENT_TYPE, (b"x-request-id", request_id.encode())]
    trace: Headers = []
    for name, value in headers:
        if name in FORWARDED_REQUEST_HEADERS:
            out.append((name, value))
        elif name in _TRACE_FIELDS:
            trace.append((name, value))
    if trace:
        out.extend(trace_context(trace))
    return out


def trace_context(fields: Headers) -> Headers:
    """The `traceparent` and `tracestate` to pass on: only one well-formed traceparent, and
    tracestate only beside it (the W3C rule: without a valid parent, state is dropped)."""
    parents = [v for n, v in fields if n == TRACE_PARENT]
    if len(parents) != 1 or _TRACE_PARENT.fullmatch(parents[0]) is None:
        return []
    states = [v for n, v in fields if n == TRACE_STATE]
    out = [(TRACE_PARENT, parents[0])]
    if len(states) == 1 and _TRACE_STATE.fullmatch(states[0]):
        out.append((TRACE_STATE, states[0]))
    return out


def credential(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The API key a request carries: `Authorization: Bearer <key>` or `x-api-key: <key>`.

    None when there is none (401). A second Authorization or x-api-key header, or both
    kinds naming different keys, is refused (400): whichever one a proxy in front reads,
    the gateway must not read another. Keys are compared in constant time.
    """
    bearer = api_key = None
    for name, value in headers:
        if name not in _CREDENTIAL_FIELDS:
            continue
        if name == b"authorization":
            if bearer is not None:
                raise _conflict("more than one Authorization header")
            scheme, _, token = value.partition(b" ")
            bearer = token.strip() if scheme.lower() == b"bearer" else b""
        else:
            if api_key is not None:
                raise _conflict("more than one x-api-key header")
            api_key = value.strip()
    if bearer is not None and api_key is not None and not hmac.compare_digest(bearer, api_key):
        raise _conflict("Authorization and x-api-key name different keys")
    key = bearer if bearer is not None else api_key
    if key is None:
        raise ApiError(
            401,
            "Missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
            type="authentication_error",
            code="missing_api_key",
        )
    return key or None


def _conflict(what: str) -> ApiError:
    return ApiError(
        400, f"Conflicting credentials: {what}; send one API key, once.", code="ambiguous_api_key"
    )


# Response headers passed back to the client. Everything else can identify or
# fingerprint the replica (server, date, x-request-id, via, set-cookie, x-*) or is
# hop-by-hop / recomputed by the edge (content-length, transfer-encoding, connection).
FORWARDED_RESPONSE_HEADERS: Final[frozenset[bytes]] = frozenset(
    {
        # JSON vs text/event-stream: the client needs it to read the body.
        b"content-type",
        # SSE responses say no-cache; intermediaries must not cache completions.
        b"cache-control",
        # 429/503 backoff hint; a number of seconds, not an identity.
        b"retry-after",
    }
)


def scrub_response_headers(headers: Iterable[tuple[bytes, bytes]]) -> Headers:
    """Keep only what a client needs from a replica's response headers."""
    return [(n, v) for n, v in headers if n in FORWARDED_RESPONSE_HEADERS]
