"""Client fields that reach shared engine state, as pure functions (issue 40, "Fields").

Request side (`check`, from `request.inspect`): request chat templates are refused (they
run in the replica's single render worker and its template caches); server-side tool types
are refused (vLLM runs them itself, on connections shared by every tenant, with the
client's `tools[].headers` merged over its own `x-session-id`); `n` and `best_of` are
capped (vLLM allows 16,384 sequences per request by default). `priority` and `session_id`
are removed by `request.prepare` (`request.STRIPPED_FIELDS`), which then sets the
gateway's own priority from the key's band when configured (`band_priority`).

Answer side (`scrub_answer`, `scrub_events`): per-request engine metrics and KV / encoder
transfer parameters are removed before the client sees an answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import orjson

from saltgate.policy.errors import ApiError, invalid_request, invalid_type

# The most sequences one request may ask for (`n`, `best_of`, and the beam width, which
# vLLM takes from `n` when `use_beam_search` is set). docs/config.md, "Fixed limits".
MAX_SEQUENCES: Final = 16
_SEQUENCE_PARAMS: Final = ("n", "best_of")

# The replica priority of each key band (governance/kinds.py), set by the gateway when
# the replicas run vLLM's priority scheduling (lower goes first there; vLLM documents a
# nonzero priority as an error under its default fcfs policy, so none is set unless
# configured: docs/fields.md).
BAND_PRIORITY: Final[Mapping[str, int]] = {"interactive": 0, "batch": 1}


def band_priority(band: str) -> int:
    """The replica priority of a key band; an unknown band gets the last (it waits)."""
    return BAND_PRIORITY.get(band, max(BAND_PRIORITY.values()))


# Tool types vLLM's Responses API runs server-side (its tool server: MCP, the Python
# container, the browser), and OpenAI's names for the same. Refused, not stripped of their
# headers: the tool server itself is shared state (sessions, containers) across tenants.
SERVER_SIDE_TOOLS: Final[frozenset[str]] = frozenset(
    {
        "mcp",
        "code_interpreter",
        "container",
        "web_search",
        "web_search_preview",
        "browser",
        "python",
        "file_search",
        "computer_use_preview",
        "image_generation",
        "local_shell",
    }
)

# Answer members that expose engine state: per-request metrics (queue time, engine
# timings), and the transfer parameters of disaggregated prefill and encoder caches.
ANSWER_FIELDS: Final[tuple[str, ...]] = ("metrics", "kv_transfer_params", "ec_transfer_params")
_METRICS: Final = b'"metrics"'
_TRANSFER: Final = b'_transfer_params"'


def _refused(message: str, param: str, code: str) -> ApiError:
    return invalid_request(message, param=param, code=code)


def check(body: Mapping[str, Any]) -> None:
    """Refuse request templates, server-side tools and too many sequences (400 naming the
    parameter)."""
    # The two spellings vLLM reads (renderers/online_renderer.py, validate_chat_template;
    # pooling/base/io_processor.py), null meaning absent there as here.
    if body.get("chat_template") is not None:
        raise _refused(
            "'chat_template' is not accepted: replicas render with their own templates.",
            "chat_template",
            "chat_template_refused",
        )
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and kwargs.get("chat_template") is not None:
        raise _refused(
            "'chat_template_kwargs.chat_template' is not accepted: replicas render with "
            "their own templates.",
            "chat_template_kwargs.chat_template",
            "chat_template_refused",
        )
    tools = body.get("tools")
    if isinstance(tools, list):
        for index, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind in SERVER_SIDE_TOOLS:
                raise _refused(
                    f"Tool type {kind!r} is not accepted: tools that run on the replica are "
                    "shared by every tenant; send function tools and run them yourself.",
                    f"tools[{index}].type",
                    "tool_type_refused",
                )
    for name in _SEQUENCE_PARAMS:
        value = body.get(name)
        if value is None:
            continue
        if type(value) is not int:
            raise invalid_type(name, "an integer")
        if value > MAX_SEQUENCES:
            raise _refused(
                f"Invalid '{name}': at most {MAX_SEQUENCES} sequences per request.",
                name,
                "too_many_sequences",
            )


def _scrub(doc: dict[str, Any]) -> bool:
    changed = False
    holders: list[Any] = [doc, doc.get("response"), doc.get("message")]
    choices = doc.get("choices")
    if isinstance(choices, list):
        holders.extend(choices)
    for holder in holders:
        if isinstance(holder, dict):
            for name in ANSWER_FIELDS:
                if name in holder:
                    del holder[name]
                    changed = True
    return changed


def scrub_answer(body: bytes) -> bytes:
    """A JSON answer without `ANSWER_FIELDS` (at the top, in `response`, `message` and each
    choice); the bytes unchanged (not parsed) when no marker is in them."""
    if _METRICS not in body and _TRANSFER not in body:  # two memchr-speed scans
        return body
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if not isinstance(doc, dict) or not _scrub(doc):
        return body
    return orjson.dumps(doc)


def scrub_events(events: bytes) -> bytes:
    """Complete SSE events (each ending in a blank line) with `ANSWER_FIELDS` removed from
    every `data:` line; unchanged (not split) when no marker is in them."""
    if _METRICS not in events and _TRANSFER not in events:
        return events
    lines = events.split(b"\n")
    for index, line in enumerate(lines):
        if line.startswith(b"data:") and (_METRICS in line or _TRANSFER in line):
            payload = line[5:].strip()
            scrubbed = scrub_answer(payload)
            if scrubbed is not payload:
                lines[index] = b"data: " + scrubbed
    return b"\n".join(lines)
