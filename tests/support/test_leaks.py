"""The secret scan (tests/support/leaks.py) finds a secret however Python printed it, so
a scan that finds nothing means something."""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass

import pytest
from tests.support.leaks import leaks

pytestmark = pytest.mark.unit

KEY = os.urandom(32)
API_KEY = "sg_" + base64.urlsafe_b64encode(os.urandom(32)).rstrip(b"=").decode()


@dataclass
class Holder:
    key: bytes


@pytest.mark.parametrize(
    "printed",
    [
        KEY.hex(),
        KEY.hex().upper(),
        repr(KEY),
        repr(Holder(KEY)),
        repr(bytearray(KEY)),
        str(list(KEY)),
        json.dumps({"key": list(KEY)}),
        json.dumps(list(KEY), separators=(",", ":")),
        base64.b64encode(KEY).decode(),
        base64.urlsafe_b64encode(KEY).rstrip(b"=").decode(),
        json.dumps(repr(KEY)),
    ],
    ids=[
        "hex",
        "HEX",
        "repr",
        "dataclass",
        "bytearray",
        "list",
        "json",
        "compact-json",
        "b64",
        "b64url",
        "json-of-repr",
    ],
)
def test_a_bytes_key_is_found_in_every_form(printed: str) -> None:
    assert leaks(f"before {printed} after", key=KEY)
    assert leaks(f"before {printed} after".encode(), key=KEY)


@pytest.mark.parametrize("quotes", [b"'", b'"', b"'\"", b"\\'"])
def test_a_key_with_quotes_is_found_in_each_repr(quotes: bytes) -> None:
    """Python picks a bytes repr's quotes by its content, and a bytearray's repr escapes
    what a bytes repr leaves bare: a random key holds a quote about one run in four."""
    key = KEY[:10] + quotes + KEY[10:]
    for printed in (repr(key), repr(bytearray(key)), repr(Holder(key)), json.dumps(repr(key))):
        assert leaks(printed, key=key), printed


def test_a_bytes_key_is_found_as_it_is_in_bytes_output() -> None:
    assert leaks(b"SQLite format 3\x00" + KEY + b"\x00", key=KEY) == {"key": ["raw bytes"]}


@pytest.mark.parametrize("before", range(4))
@pytest.mark.parametrize("after", range(3))
def test_a_key_is_found_inside_a_longer_base64_encoding(before: int, after: int) -> None:
    blob = os.urandom(before) + KEY + os.urandom(after)
    assert leaks(base64.b64encode(blob).decode(), key=KEY)
    assert leaks(base64.urlsafe_b64encode(blob).decode(), key=KEY)


@pytest.mark.parametrize(
    "printed",
    [
        f"Bearer {API_KEY}",
        repr({"authorization": API_KEY}),
        repr(API_KEY.encode()),
        API_KEY.encode().hex(),
        base64.b64encode(f"user:{API_KEY}".encode()).decode(),  # HTTP basic auth
    ],
    ids=["text", "repr", "bytes", "hex", "basic-auth"],
)
def test_a_text_key_is_found_in_every_form(printed: str) -> None:
    assert leaks(printed, api_key=API_KEY)


def test_the_scan_names_the_secret_and_form_and_finds_nothing_in_clean_output() -> None:
    assert leaks(f"x={KEY.hex()}", key=KEY, api_key=API_KEY) == {"key": ["hex"]}
    assert leaks(repr(Holder(os.urandom(32))) + API_KEY[:-1], key=KEY, api_key=API_KEY) == {}
