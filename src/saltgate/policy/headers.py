"""Header policy: what crosses the gateway in each direction (allow-lists, never deny-lists).

Names arrive as lower-case bytes (httptools). Anything not listed is dropped, so a header
a backend might act on (``x-tenant-id`` as a salt source, ``x-request-id`` as the engine's
request id, ``accept-encoding``) cannot be smuggled through by a new spelling.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

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
#   x-tenant-id, x-request-id, traceparent, cookie, x-stainless-*, openai-organization,
#   openai-project, x-forwarded-* - salt sources, engine request ids (collisions),
#                      cross-boundary tracing and client fingerprints


def forward_request_headers(headers: Iterable[tuple[bytes, bytes]]) -> Headers:
    """The headers to send upstream: content-type fixed to JSON, then the allow-listed ones.

    Host, content-length and authorization are added by the forwarder.
    """
    out: Headers = [JSON_CONTENT_TYPE]
    out.extend((n, v) for n, v in headers if n in FORWARDED_REQUEST_HEADERS)
    return out


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
