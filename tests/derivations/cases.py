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

# Replica ranking: route keys (any 32 bytes) and replicas (id = URL, capacity weight).
RANKING_KEYS: list[bytes] = [bytes(32), b"\xff" * 32, bytes(range(32)), bytes(range(32, 64))]
RANKING_MEMBERS: list[tuple[str, float]] = [
    ("http://10.0.0.1:8000", 1.0),
    ("http://10.0.0.2:8000", 1.0),
    ("http://10.0.0.3:8000", 2.5),
    ("http://10.0.0.4:8000", 0.5),
    ("http://réplica-ü.internal:8000", 1.0),
]

# Prefix digests: a flattened prompt (any bytes) cut at 1024, 2048, 4096, ... bytes.
PREFIX_FLAT: bytes = ("S" + "You are terse. " * 300 + "U" + "Grüße " * 100).encode()
PREFIX_FIRST_DEPTHS: list[int] = [1024, 100]

# KV relay: vLLM block hashes (unsigned 64-bit) and upstream replica names.
KV_BLOCK_HASHES: list[int] = [0, 1, 0x1111_2222_3333_4444, 0x8000_0000_0000_0000, 2**64 - 1]
KV_REPLICA_NAMES: list[str] = ["tcp://10.0.0.5:5557", "ipc:///tmp/kv-0", "kv@réplica-0", ""]
# Cluster-bus batch payloads to tag (any bytes: the tag does not parse them).
CLUSTER_PAYLOADS: list[bytes] = [b"", b"\x00", bytes(range(256))]
