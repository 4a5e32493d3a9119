"""Behaviour of the route window: what moves it, what must not, and the floor."""

from __future__ import annotations

from typing import Any

import pytest

from saltgate.derivations import (
    InvalidSecretError,
    prompt_size,
    route_window,
    validate_user_cache_secret,
)

pytestmark = pytest.mark.unit

CHAT = "/v1/chat/completions"
LONG = "L" * 5000


def chat(*messages: tuple[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages], **extra}


def test_short_prompts_get_no_window_unless_a_prompt_cache_key_is_given() -> None:
    short = chat(("user", "hello"))
    assert route_window(short, CHAT) is None
    keyed = route_window({**short, "prompt_cache_key": "conv-1"}, CHAT)
    assert keyed is not None and keyed.startswith(b"K\x00\x00\x00\x06conv-1")
    assert route_window({**short, "prompt_cache_key": ""}, CHAT) is None


def test_floor_counts_every_message_and_tools() -> None:
    body = chat(("system", "s" * 2000), ("user", "u" * 1000), ("assistant", "a" * 1096))
    assert prompt_size(body, CHAT) == 4096
    assert route_window(body, CHAT) is not None
    body["messages"][2]["content"] = "a" * 1095
    assert route_window(body, CHAT) is None
    body["tools"] = [{"x": 1}]  # '[{"x":1}]' = 9 bytes
    assert prompt_size(body, CHAT) == 4095 + 9
    assert prompt_size(chat(("user", "é")), CHAT) == 2  # UTF-8 bytes, not characters


@pytest.mark.parametrize("role", [["system"], {"r": 1}, 7, None])
def test_a_role_that_is_not_a_string_is_neither_system_nor_user(role: object) -> None:
    """Any JSON value can arrive as a role; none may raise (it once did: a 500 for a list)."""
    body = chat((role, LONG), ("user", "q"))  # type: ignore[arg-type]
    assert route_window(body, CHAT) == b"U\x00\x00\x00\x01q"
    assert prompt_size(body, CHAT) == len(LONG) + 1


def test_later_turns_do_not_move_the_window() -> None:
    first = chat(("system", LONG), ("user", "question one"))
    later = chat(("system", LONG), ("user", "question one"), ("assistant", "a"), ("user", "two"))
    assert route_window(first, CHAT) == route_window(later, CHAT)


def test_a_growing_completion_prompt_keeps_its_window() -> None:
    base = "P" * 5000
    w1 = route_window({"model": "m", "prompt": base}, "/v1/completions")
    w2 = route_window({"model": "m", "prompt": base + " and more"}, "/v1/completions")
    assert w1 is not None and w1 == w2 and len(w1) == 1024


def test_what_begins_the_prompt_moves_the_window() -> None:
    base = route_window(chat(("system", LONG), ("user", "q")), CHAT)
    assert route_window(chat(("system", LONG), ("user", "r")), CHAT, window_bytes=8192) != (
        route_window(chat(("system", LONG), ("user", "q")), CHAT, window_bytes=8192)
    )
    assert route_window(chat(("system", "X" + LONG), ("user", "q")), CHAT) != base
    assert route_window(chat(("developer", LONG), ("user", "q")), CHAT) == base  # same text


def test_fields_cannot_be_confused() -> None:
    pad = ("system", LONG)
    a = route_window(chat(pad, ("system", "ab"), ("user", "c")), CHAT, window_bytes=8192)
    b = route_window(chat(pad, ("system", "a"), ("user", "bc")), CHAT, window_bytes=8192)
    assert a != b
    s_then_u = route_window(chat(("system", LONG), ("user", "x")), CHAT, window_bytes=8192)
    u_only = route_window(chat(("user", LONG + "x")), CHAT, window_bytes=8192)
    assert s_then_u != u_only


def test_tools_are_canonical() -> None:
    t1 = [{"type": "function", "function": {"name": "f", "description": "d"}}]
    t2 = [{"function": {"description": "d", "name": "f"}, "type": "function"}]
    w1 = route_window(chat(("user", LONG), tools=t1), CHAT)
    w2 = route_window(chat(("user", LONG), tools=t2), CHAT)
    assert w1 == w2 and w1 is not None and w1.startswith(b"T")
    assert route_window(chat(("user", LONG), tools=[]), CHAT) == route_window(
        chat(("user", LONG)), CHAT
    )


def test_content_parts_concatenate_their_text() -> None:
    parts = [{"type": "text", "text": LONG[:2500]}, {"type": "image_url", "image_url": {}}]
    parts.append({"type": "text", "text": LONG[2500:]})
    assert route_window(chat(("user", parts)), CHAT) == route_window(chat(("user", LONG)), CHAT)


def test_window_length_is_a_parameter() -> None:
    body = chat(("system", LONG), ("user", "q"))
    for w in (0, 5, 6, 64, 1024, 2048):
        window = route_window(body, CHAT, window_bytes=w)
        assert window is not None and len(window) == (w if w > 5 else 0)
    w64 = route_window(body, CHAT, window_bytes=64)
    w128 = route_window(body, CHAT, window_bytes=128)
    assert w64 is not None and w128 is not None and w64[5:] == w128[5:64]
    with pytest.raises(ValueError, match="window_bytes"):
        route_window(body, CHAT, window_bytes=-1)


@pytest.mark.parametrize(
    ("route", "body", "tags"),
    [
        ("/v1/completions", {"prompt": [1, 2, 3] * 2000}, b"I"),
        ("/v1/completions", {"prompt": ["P" * 5000, "other"]}, b"P"),
        ("/v1/responses", {"instructions": LONG, "input": "hi"}, b"SU"),
        ("/v1/responses", {"input": [{"role": "user", "content": LONG}]}, b"U"),
        ("/v1/messages", {"system": LONG, "messages": [{"role": "user", "content": "q"}]}, b"SU"),
    ],
)
def test_routes_pick_their_prompt_fields(route: str, body: dict[str, Any], tags: bytes) -> None:
    window = route_window({"model": "m", **body}, route, window_bytes=1 << 16)
    assert window is not None
    seen = b""
    pos = 0
    while pos < len(window):
        seen += window[pos : pos + 1]
        pos += 5 + int.from_bytes(window[pos + 1 : pos + 5], "big")
    assert seen == tags


def test_token_ids_render_as_decimal() -> None:
    window = route_window({"model": "m", "prompt": [12, 345, 6] * 400}, "/v1/completions")
    assert window is not None and window[5:15] == b"12,345,6,1"


def test_work_is_bounded_by_the_window_not_the_prompt() -> None:
    body = chat(("system", "é" * 2_000_000), ("user", "q"))
    window = route_window(body, CHAT)
    assert window is not None and len(window) == 1024


# -- user_cache_secret --------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, ""])
def test_absent_or_empty_secret_means_none(value: object) -> None:
    assert validate_user_cache_secret(value) is None


@pytest.mark.parametrize("value", ["a" * 16, "b" * 256, "密" * 16, "9f" * 32])
def test_valid_secrets_pass(value: str) -> None:
    assert validate_user_cache_secret(value) == value


@pytest.mark.parametrize(
    "value", ["short-secret-15", "x" * 257, 7, 1.5, True, ["a" * 16], {"s": "a" * 16}]
)
def test_invalid_secrets_state_the_rule_without_echo(value: object) -> None:
    with pytest.raises(InvalidSecretError) as info:
        validate_user_cache_secret(value)
    message = str(info.value)
    assert "user_cache_secret" in message and "16" in message and "256" in message
    if isinstance(value, str):
        assert value not in message
