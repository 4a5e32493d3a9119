"""Spec v1 pinned two ways: against an independent implementation, and against stored vectors."""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path
from typing import Any

import orjson
import pytest

from saltgate.derivations import (
    SubKeys,
    b64url_nopad,
    cache_salt,
    derive_subkeys,
    lp,
    route_key,
    route_window,
)

from . import reference as ref
from .cases import MASTER_KEYS, ROUTE_BODIES, SALT_INPUTS, WINDOWS

pytestmark = pytest.mark.unit

VECTORS: dict[str, Any] = json.loads(
    Path(__file__).with_name("vectors_v1.json").read_text(encoding="utf-8")
)
SALT_RE = re.compile(r"^sg1_[A-Za-z0-9_-]{43}$")


# -- the reference itself is right ------------------------------------------------------


def test_reference_hkdf_matches_rfc5869() -> None:
    ikm = b"\x0b" * 22
    # A.1: with salt and info
    okm = ref.hkdf_sha256(ikm, bytes(range(0xF0, 0xFA)), 42, salt=bytes(range(13)))
    assert okm.hex() == (
        "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865"
    )
    # A.3: no salt, no info -- the case spec v1 uses (with info)
    assert ref.hkdf_sha256(ikm, b"", 42).hex() == (
        "8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d9d201395faa4b61a96c8"
    )


def test_reference_hmac_matches_rfc4231_case2() -> None:
    mac = ref.hmac_sha256(b"Jefe", b"what do ya want for nothing?")
    assert mac.hex() == "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"


# -- package == independent implementation ----------------------------------------------


@pytest.mark.parametrize("master", MASTER_KEYS, ids=lambda k: f"{len(k)}B-{k[:2].hex()}")
def test_subkeys_match_reference(master: bytes) -> None:
    sk = derive_subkeys(master)
    expected = ref.subkeys(master)
    assert (sk.salt, sk.route, sk.kv_events) == (
        expected["salt"],
        expected["route"],
        expected["kv_events"],
    )
    assert len({sk.salt, sk.route, sk.kv_events}) == 3


@pytest.mark.parametrize(("tenant", "epoch", "secret"), SALT_INPUTS)
def test_cache_salt_matches_reference(tenant: str, epoch: str, secret: str | None) -> None:
    for master in MASTER_KEYS:
        k = derive_subkeys(master).salt
        assert cache_salt(k, tenant, epoch, secret) == ref.cache_salt(k, tenant, epoch, secret)


@pytest.mark.parametrize(("route", "body"), ROUTE_BODIES, ids=lambda x: str(x)[:30])
def test_route_window_and_key_match_reference(route: str, body: dict[str, Any]) -> None:
    sk = derive_subkeys(MASTER_KEYS[1])
    salt = cache_salt(sk.salt, "tenant-x", "0", None)
    for w in [*WINDOWS, 0, 5, 6, 9, 300]:
        window = route_window(body, route, window_bytes=w)
        assert window == ref.window(body, route, w), (route, w)
        if window is not None:
            assert len(window) <= w
            expected = ref.route_key(sk.route, body["model"], salt, window)
            assert route_key(sk.route, body["model"], salt, window) == expected


def test_route_window_matches_reference_on_random_bodies() -> None:
    rng = random.Random(7)
    routes = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]

    def text() -> str:
        n = rng.choice([0, 1, 3, 40, 700, 3000])
        return "".join(rng.choice('ab: é漢😀\n"') for _ in range(n))

    def content() -> Any:
        if rng.random() < 0.5:
            return text()
        parts: list[Any] = [{"type": "text", "text": text()} for _ in range(rng.randint(0, 3))]
        parts.insert(rng.randint(0, len(parts)), {"type": "image_url", "image_url": {"u": 1}})
        return parts

    for _ in range(300):
        route = rng.choice(routes)
        roles = ["system", "developer", "user", "assistant", "tool"]
        messages = [{"role": rng.choice(roles), "content": content()} for _ in range(5)]
        body: dict[str, Any] = {"model": "m", "messages": messages}
        if rng.random() < 0.3:
            body["tools"] = [{"name": text()[:20], "x": rng.random() * 10 ** rng.randint(-9, 20)}]
        if rng.random() < 0.2:
            body["prompt_cache_key"] = text()[:30]
        if route == "/v1/completions":
            body["prompt"] = rng.choice(
                [text(), [rng.randint(0, 10**6) for _ in range(rng.randint(0, 2000))], [text()]]
            )
        if route == "/v1/responses":
            body["instructions"] = text()
            body["input"] = text() if rng.random() < 0.5 else messages
        if route == "/v1/messages":
            body["system"] = content()
        w = rng.choice([16, 100, 1024])
        floor = rng.choice([0, 500, 4096])
        got = route_window(body, route, window_bytes=w, min_prompt_bytes=floor)
        assert got == ref.window(body, route, w, floor)


def test_canonical_tools_json_matches_the_documented_float_format() -> None:
    """orjson's sorted output equals the spec's canonical JSON (reference serialiser)."""
    rng = random.Random(3)
    floats = [0.1, 1e-5, 1.5e-7, 1e16, 1e15, 123.0, -0.0, 5e-324, 1.7976931348623157e308]
    floats += [rng.uniform(-1, 1) * 10 ** rng.randint(-30, 30) for _ in range(3000)]
    floats += [float(rng.randint(-(10**18), 10**18)) for _ in range(500)]
    for x in floats:
        assert orjson.dumps(x).decode() == ref.format_float(x), repr(x)
    doc = {
        "é": [1, -2, 2**63, '\x00\x1f"\\/\u2028😀'],
        "a": {"z": None, "b": True},
        "😀": 1,
        "\uffff": 2,
    }
    assert orjson.dumps(doc, option=orjson.OPT_SORT_KEYS).decode() == ref.canonical_json(doc)


# -- package == stored vectors -----------------------------------------------------------


def test_stored_subkeys() -> None:
    for v in VECTORS["subkeys"]:
        sk = derive_subkeys(bytes.fromhex(v["master_key"]))
        assert sk.salt.hex() == v["salt"]
        assert sk.route.hex() == v["route"]
        assert sk.kv_events.hex() == v["kv_events"]


def test_stored_salts() -> None:
    assert len(VECTORS["salts"]) == len(SALT_INPUTS)
    for v in VECTORS["salts"]:
        k = derive_subkeys(bytes.fromhex(v["master_key"])).salt
        got = cache_salt(k, v["tenant_id"], v["epoch"], v["user_cache_secret"])
        assert got == v["cache_salt"]


def test_stored_routes() -> None:
    assert len(VECTORS["routes"]) == len(ROUTE_BODIES)
    keyed = 0
    for case in VECTORS["routes"]:
        k = derive_subkeys(bytes.fromhex(MASTER_KEYS[0].hex())).route
        for v in case["windows"]:
            window = route_window(case["body"], case["route"], window_bytes=v["window_bytes"])
            if v["route_key"] is None:
                assert window is None
                continue
            keyed += 1
            assert window is not None
            assert hashlib.sha256(window).hexdigest() == v["window_sha256"]
            if v["window"] is not None:
                assert window.hex() == v["window"]
            assert route_key(k, case["body"]["model"], case["salt"], window).hex() == v["route_key"]
    assert keyed >= 20  # the table exercises keyed requests, not only the floor


# -- properties ---------------------------------------------------------------------------


def _vllm_accepts(salt: str) -> bool:
    """vLLM's cache_salt validator: 1..128 characters, no @ / \\ or NUL (docs/conformance.md)."""
    return 0 < len(salt) <= 128 and not any(c in salt for c in "@/\\\x00")


def test_salts_have_the_documented_shape() -> None:
    k = derive_subkeys(MASTER_KEYS[0]).salt
    for tenant, epoch, secret in SALT_INPUTS:
        salt = cache_salt(k, tenant, epoch, secret)
        assert len(salt) == 47
        assert SALT_RE.match(salt), salt
        assert _vllm_accepts(salt)


def test_every_input_moves_the_salt() -> None:
    k = derive_subkeys(MASTER_KEYS[0]).salt
    salts = {cache_salt(k, t, e, s) for t, e, s in SALT_INPUTS}
    assert len(salts) == len(SALT_INPUTS)
    base = cache_salt(k, "t", "0", None)
    assert cache_salt(k, "u", "0", None) != base  # tenant
    assert cache_salt(k, "t", "1", None) != base  # epoch rotation
    assert cache_salt(k, "t", "0", "s" * 16) != base  # mode
    assert cache_salt(k, "t", "0", "s" * 16) != cache_salt(k, "t", "0", "s" * 15 + "t")  # secret
    assert cache_salt(derive_subkeys(MASTER_KEYS[1]).salt, "t", "0", None) != base  # cluster


def test_empty_secret_is_the_tenant_namespace() -> None:
    k = derive_subkeys(MASTER_KEYS[0]).salt
    assert cache_salt(k, "t", "0", "") == cache_salt(k, "t", "0", None)


def test_length_prefix_removes_boundary_ambiguity() -> None:
    k = derive_subkeys(MASTER_KEYS[0]).salt
    assert cache_salt(k, "ab", "c", None) != cache_salt(k, "a", "bc", None)
    # a tenant-mode input cannot be dressed up as a user-mode one either
    assert cache_salt(k, "t", "0", "x" * 16) != cache_salt(k, "t", "0" + "x" * 16, None)
    assert lp(b"ab") + lp(b"c") != lp(b"a") + lp(b"bc")
    assert lp(b"") == b"\x00\x00\x00\x00"
    assert lp(b"xyz") == b"\x00\x00\x00\x03xyz"


def test_route_key_separates_model_salt_and_window() -> None:
    k = derive_subkeys(MASTER_KEYS[0]).route
    base = route_key(k, "m", "s", b"w")
    assert len(base) == 32
    assert route_key(k, "m2", "s", b"w") != base
    assert route_key(k, "m", "s2", b"w") != base
    assert route_key(k, "m", "s", b"w2") != base
    assert route_key(k, "ms", "", b"w") != route_key(k, "m", "s", b"w")


def test_b64url_nopad() -> None:
    assert b64url_nopad(b"") == ""
    assert b64url_nopad(b"\xfb\xff") == "-_8"
    assert b64url_nopad(bytes(32)) == "A" * 43


def test_master_key_rules_and_no_echo() -> None:
    short = b"secret-material-31-bytes-long!!"
    assert len(short) == 31
    with pytest.raises(ValueError, match="at least 32") as info:
        derive_subkeys(short)
    assert short.decode() not in str(info.value)
    assert short.hex() not in str(info.value)
    sk = derive_subkeys(b"z" * 32)
    assert isinstance(sk, SubKeys)
    assert sk.salt.hex() not in repr(sk) and "redacted" in repr(sk)


def test_cache_salt_refuses_an_empty_tenant() -> None:
    with pytest.raises(ValueError, match="tenant_id"):
        cache_salt(b"k" * 32, "", "0", None)
