"""Adversarial corpus for issue 40's "Fields": client fields that reach a replica's shared
state, in every route's shape, nested and duplicated (tests/policy/test_fields.py runs it
through the pure policy, tests/gateway/test_fields.py through a gateway to a recording
replica). Media has its own corpus (adversarial_media.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from saltgate.policy.fields import MAX_SEQUENCES

MODEL = "m"
# A minimal valid body per forwarded route's shape.
SHAPES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"prompt": "hi"},
    "/v1/responses": {"input": "hi"},
    "/v1/messages": {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
    "/tokenize": {"prompt": "hi"},
    "/v1/embeddings": {"input": "hi"},
}
# Fields the gateway removes, with the values an attacker would send.
STRIPPED: dict[str, Any] = {
    "priority": -1000,
    "session_id": "alice-session",
}
# Fields (and shapes) the gateway refuses, with the parameter the 400 names.
REFUSED: list[tuple[str, str, dict[str, Any]]] = [
    ("chat_template", "chat_template", {"chat_template": "{{ 'x' * 10**9 }}"}),
    (
        "chat_template_kwargs",
        "chat_template_kwargs.chat_template",
        {"chat_template_kwargs": {"chat_template": "{{ x }}", "enable_thinking": True}},
    ),
    ("n", "n", {"n": 100000}),
    ("n_just_over", "n", {"n": MAX_SEQUENCES + 1}),
    ("best_of", "best_of", {"best_of": 100000}),
    ("beam", "n", {"use_beam_search": True, "n": 100000}),
    (
        "mcp_headers",
        "tools[0].type",
        {
            "tools": [
                {
                    "type": "mcp",
                    "server_label": "x",
                    "server_url": "http://127.0.0.1:1/",
                    "headers": {"x-session-id": "alice-request"},
                }
            ]
        },
    ),
    (
        "code_interpreter",
        "tools[1].type",
        {"tools": [{"type": "function", "name": "f"}, {"type": "code_interpreter"}]},
    ),
    ("web_search_preview", "tools[0].type", {"tools": [{"type": "web_search_preview"}]}),
    ("container", "tools[0].type", {"tools": [{"type": "container"}]}),
]
# Answers as replicas write them with per-request metrics / disaggregation on.
ANSWER_FIELDS_SEEN: list[dict[str, Any]] = [
    {"id": "c", "choices": [{"index": 0, "text": "x"}], "metrics": {"queue_time": 0.1}},
    {"id": "c", "kv_transfer_params": {"remote_block_ids": [1, 2]}, "choices": []},
    {"id": "c", "choices": [{"index": 0, "metrics": {"ttft": 1}}]},
    {"id": "e", "type": "response.completed", "response": {"id": "r", "metrics": {}}},
    {"id": "r", "ec_transfer_params": {"x": 1}, "kv_transfer_params": None},
    {"id": "m", "type": "message_start", "message": {"id": "m", "kv_transfer_params": {}}},
]


@dataclass(frozen=True)
class Case:
    name: str
    route: str
    body: dict[str, Any]
    leaked: Callable[[dict[str, Any]], bool] = lambda seen: False
    param: str = ""


def _leaked(seen: dict[str, Any]) -> bool:
    return any(name in seen for name in STRIPPED)


def stripped_cases() -> Iterator[Case]:
    """Every stripped field on every route, alone and all at once."""
    for route, shape in SHAPES.items():
        for name, value in STRIPPED.items():
            yield Case(f"{name}@{route}", route, {"model": MODEL, **shape, name: value}, _leaked)
        yield Case(f"all@{route}", route, {"model": MODEL, **shape, **STRIPPED}, _leaked)


def refused_cases() -> Iterator[Case]:
    """Every refused field on every route, also beside the stripped ones."""
    for route, shape in SHAPES.items():
        for name, param, extra in REFUSED:
            body = {"model": MODEL, **shape, **extra}
            yield Case(f"{name}@{route}", route, body, param=param)
            yield Case(f"{name}+stripped@{route}", route, {**body, **STRIPPED}, param=param)


def raw_duplicates() -> Iterator[tuple[str, bytes]]:
    """Duplicated keys (a later copy hiding from a first-key reader): refused at parse."""
    for name, value in [("priority", "-1000"), ("n", "100000"), ("chat_template", '"x"')]:
        yield (
            name,
            b'{"model":"m","prompt":"hi","'
            + name.encode()
            + b'":1,"'
            + name.encode()
            + b'":'
            + value.encode()
            + b"}",
        )
