"""Inputs of the spec v1 vector table (shared by the generator and the tests)."""

from __future__ import annotations

from typing import Any

MASTER_KEYS: list[bytes] = [
    bytes(range(32)),
    b"\xff" * 32,
    bytes(range(64)),  # longer than the minimum
]

SECRET_16 = "0123456789abcdef"
SECRET_256 = ("k7" * 128)[:256]
SECRET_64 = "9f" * 32  # what Tinfoil's SDKs send: 32 random bytes as hex

# (tenant_id, epoch, user_cache_secret)
SALT_INPUTS: list[tuple[str, str, str | None]] = [
    ("tenant-a", "0", None),
    ("tenant-a", "1", None),
    ("tenant-a", "0", SECRET_16),
    ("tenant-a", "0", SECRET_64),
    ("tenant-a", "0", SECRET_256),
    ("tenant-b", "0", None),
    ("ab", "c", None),
    ("a", "bc", None),
    ("Zürich-Ω-租户", "0", None),
    ("Zürich-Ω-租户", "0", "sécret-ünicode-密钥-0001"),
    ("t", "", None),
    ("t", "0", "user"[:4] * 4),
]

_LONG = "You are a careful assistant. " * 150  # 4350 bytes, over the 4096-byte floor

ROUTE_BODIES: list[tuple[str, dict[str, Any]]] = [
    (
        "/v1/chat/completions",
        {
            "model": "m",
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"b": 1.5e-7, "a": [1, 2e20, -0.0, None, True]},
                    },
                }
            ],
            "messages": [
                {"role": "system", "content": _LONG},
                {
                    "role": "developer",
                    "content": [
                        {"type": "text", "text": "dev "},
                        {"type": "image_url", "image_url": {"url": "x"}},
                        {"type": "text", "text": "notes"},
                    ],
                },
                {"role": "user", "content": "Grüße: first question"},
                {"role": "assistant", "content": "answer"},
                {"role": "user", "content": "second"},
            ],
        },
    ),
    (
        "/v1/chat/completions",
        {
            "model": "m",
            "prompt_cache_key": "conv-42",
            "messages": [{"role": "user", "content": "hi"}],
        },
    ),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "short"}]}),
    ("/v1/completions", {"model": "m", "prompt": "P" * 5000}),
    ("/v1/completions", {"model": "m", "prompt": [1000 + i % 7 for i in range(1100)]}),
    ("/v1/completions", {"model": "m", "prompt": [[7, 8, 9] * 400, [1]]}),
    (
        "/v1/responses",
        {
            "model": "m",
            "instructions": _LONG,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "q"}]}],
        },
    ),
    ("/v1/responses", {"model": "m", "instructions": "be brief", "input": "x" * 4100}),
    (
        "/v1/messages",
        {
            "model": "m",
            "system": [{"type": "text", "text": _LONG}],
            "messages": [{"role": "user", "content": "hello"}],
        },
    ),
]

WINDOWS: list[int] = [1024, 64, 4096]
