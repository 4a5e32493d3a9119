"""Reading token usage out of replica responses, whole or streamed (pure, no I/O).

Metering needs the usage a replica reports. For streams the gateway forces
`stream_options.include_usage` on, so the last data event carries it; when the client
did not ask for usage, that event is removed again so the client sees what it asked for.
The SSE scanner only parses events that can hold usage, so passing a stream through
costs a substring search per event, not a JSON parse.
"""

from __future__ import annotations

from typing import Any, Final, NamedTuple

import orjson

from saltgate.derivations.derive import ROUTE_CHAT, ROUTE_MESSAGES, ROUTE_RESPONSES


class Usage(NamedTuple):
    """What a replica reported. `cached_tokens` is None when it did not say: vLLM reports
    them only with `--enable-prompt-tokens-details`, and an unreported count is unknown,
    not 0 (billing it as 0 would charge cache hits at the full input price)."""

    prompt_tokens: int = 0
    cached_tokens: int | None = 0
    completion_tokens: int = 0


# No request has a billion tokens: a larger count is as much garbage as a negative one, and
# two of them (Anthropic's input + cache reads) still fit the ledger's 32-bit columns.
MAX_REPORTED_TOKENS = 1_000_000_000


def _count(value: Any) -> int | None:
    """A token count as reported, or None if absent, null or garbage."""
    return value if type(value) is int and 0 <= value <= MAX_REPORTED_TOKENS else None


def _int(value: Any) -> int:
    return _count(value) or 0


def usage_from_object(usage: Any) -> Usage | None:
    """Understands the OpenAI chat/completions, Responses and Anthropic Messages shapes."""
    if not isinstance(usage, dict):
        return None
    if "prompt_tokens" in usage:
        details = usage.get("prompt_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
        return Usage(_int(usage.get("prompt_tokens")), cached, _int(usage.get("completion_tokens")))
    if "input_tokens" in usage or "output_tokens" in usage:
        details = usage.get("input_tokens_details")
        if isinstance(details, dict):
            cached = _count(details.get("cached_tokens"))
            prompt = _int(usage.get("input_tokens"))
        else:
            # Anthropic: input_tokens is what neither read nor wrote the cache. vLLM
            # leaves both cache fields out without --enable-prompt-tokens-details (its
            # input_tokens is then the whole prompt): cache reads unknown, not 0.
            cached = _count(usage.get("cache_read_input_tokens"))
            written = _int(usage.get("cache_creation_input_tokens"))
            prompt = _int(usage.get("input_tokens")) + (cached or 0) + written
        return Usage(prompt, cached, _int(usage.get("output_tokens")))
    return None


def usage_from_body(body: bytes) -> Usage | None:
    """Usage of a whole (non-streamed) JSON response, or None if it has none."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    found = usage_from_object(doc.get("usage"))
    if found is None and isinstance(doc.get("response"), dict):
        found = usage_from_object(doc["response"].get("usage"))
    return found


def _merge(old: Usage | None, new: Usage) -> Usage:
    """Anthropic streams split usage over message_start and message_delta events."""
    if old is None:
        return new
    cached = old.cached_tokens
    if cached is None or (new.cached_tokens is not None and new.cached_tokens > cached):
        cached = new.cached_tokens  # an event that says nothing of the cache keeps what one did
    return Usage(
        max(old.prompt_tokens, new.prompt_tokens),
        cached,
        max(old.completion_tokens, new.completion_tokens),
    )


class SseUsageScanner:
    """Feed raw SSE bytes; get back the bytes to forward, and the usage seen so far.

    Events are forwarded whole as soon as they are complete. With `drop_usage_event`, the
    usage-only event the gateway asked for (no choices, a usage object) is removed.
    `events` counts the events passed (what a stream cut short delivered).
    """

    __slots__ = ("_buffer", "drop_usage_event", "events", "usage")

    def __init__(self, *, drop_usage_event: bool) -> None:
        self.drop_usage_event = drop_usage_event
        self.usage: Usage | None = None
        self.events = 0
        self._buffer = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._buffer + chunk if self._buffer else chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._buffer = data
            return b""
        complete, self._buffer = data[: end + 2], data[end + 2 :]
        self.events += complete.count(b"\n\n")
        if b'"usage"' not in complete:
            return complete
        kept = [event for event in complete.split(b"\n\n")[:-1] if self._keep(event)]
        return b"".join(event + b"\n\n" for event in kept)

    def flush(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return rest

    def _keep(self, event: bytes) -> bool:
        if b'"usage"' not in event:
            return True
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            try:
                doc = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                continue
            if not isinstance(doc, dict):
                continue
            holder = doc.get("response") if isinstance(doc.get("response"), dict) else doc
            message = doc.get("message")
            if isinstance(message, dict) and "usage" in message:
                holder = message
            assert isinstance(holder, dict)
            found = usage_from_object(holder.get("usage"))
            if found is None:
                continue
            self.usage = _merge(self.usage, found)
            if self.drop_usage_event and doc.get("choices") == []:
                return False
        return True


# Events of a stream that open it rather than carry output: chat's role delta; Anthropic's
# message_start and content_block_start (vLLM sends no `ping`, unlike Anthropic's API:
# vllm/entrypoints/anthropic/serving.py); the Responses API's created, in_progress,
# output_item.added and content_part.added.
_OPENING_EVENTS: Final = {ROUTE_CHAT: 1, ROUTE_MESSAGES: 2, ROUTE_RESPONSES: 4}


def delivered_usage(route: str, scanner: SseUsageScanner, prompt_estimate: int) -> Usage:
    """What a stream cut short (the gateway stopping) delivered, for its record: the usage
    the replica reported so far, else its output counted one token per output event
    relayed (vLLM sends an event per engine step, each with at least one token) and its
    prompt estimated (a token per 4 bytes of the body); cached tokens unknown."""
    output = max(scanner.events - _OPENING_EVENTS.get(route, 0), 0)
    reported = scanner.usage
    if reported is None:
        return Usage(prompt_estimate, None, output)
    prompt = reported.prompt_tokens or prompt_estimate
    return Usage(prompt, reported.cached_tokens, max(reported.completion_tokens, output))
