"""The SDK's transport without sockets: splicing, fail-closed answers, trust decisions."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from saltgate.client.transport import GatewayKeyError, SaltgateTransport, splice_secret
from saltgate.ehbp.frames import (
    ENCAPSULATED_KEY_HEADER,
    KEYS_MEDIA_TYPE,
    KEYS_PATH,
    RESPONSE_NONCE_HEADER,
    EhbpError,
    ServerKey,
)

pytestmark = pytest.mark.unit

SECRET = "0123456789abcdef0123456789abcdef"
GATEWAY = "http://gw.test"

# -- splicing ------------------------------------------------------------------------------


def test_splicing_keeps_every_other_byte_as_written() -> None:
    body = (
        b' \n{"model":"m", "seed": 123456789012345678901234567890, "temperature": 1.0E+0,'
        b' "prompt": "caf\\u00e9 \\ud83d\\ude00", "z": [1, 2], "a": {"user_cache_secret": 1}}'
    )
    out = splice_secret(body, SECRET)
    member = b'"user_cache_secret":"' + SECRET.encode() + b'",'
    assert out == body[:3] + member + body[3:]
    assert json.loads(out) == {**json.loads(body), "user_cache_secret": SECRET}


def test_splicing_leaves_bodies_it_must_not_touch() -> None:
    for body in (
        b'{"model":"m","user_cache_secret":""}',  # the caller's choice wins, even ""
        b'{"model":"m","user_cache_secret":"mine-0123456789abcdef"}',
        b'["not", "an", "object"]',
        b'"text"',
        b"{not json",
        b"",
    ):
        assert splice_secret(body, SECRET) == body
    assert json.loads(splice_secret(b"{ }", SECRET)) == {"user_cache_secret": SECRET}
    quoted = 'quote" and \\ backslash 0123456789'
    assert json.loads(splice_secret(b"{}", quoted)) == {"user_cache_secret": quoted}


# -- a gateway made of the pure server side, behind httpx.MockTransport -------------------


class FakeGateway:
    """Serves the key config and opens sealed bodies; `answer` shapes the reply."""

    def __init__(self) -> None:
        self.key = ServerKey.generate()
        self.seen: list[bytes] = []
        self.answer: Callable[[httpx.Request, bytes], httpx.Response] = self.sealed_echo

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == KEYS_PATH:
            return httpx.Response(
                200, headers={"content-type": KEYS_MEDIA_TYPE}, content=self.key.config.encode()
            )
        enc = request.headers.get(ENCAPSULATED_KEY_HEADER)
        if enc is None:
            self.seen.append(request.content)
            return httpx.Response(200, json={"plaintext": True})
        opened = self.key.open_request(bytes.fromhex(enc), request.content)
        self.seen.append(opened.plaintext)
        return self.answer(request, opened.plaintext)

    def sealed_echo(self, request: httpx.Request, plaintext: bytes) -> httpx.Response:
        enc = bytes.fromhex(request.headers[ENCAPSULATED_KEY_HEADER])
        opened = self.key.open_request(enc, request.content)
        nonce = os.urandom(32)
        sealer = opened.response_sealer(nonce)
        return httpx.Response(
            200,
            headers={RESPONSE_NONCE_HEADER: nonce.hex()},
            content=sealer.seal(plaintext[:10]) + sealer.seal(plaintext[10:]),
        )


def client_for(fake: FakeGateway, tmp: Path, **kw: object) -> httpx.Client:
    transport = SaltgateTransport(
        GATEWAY,
        user_cache_secret=SECRET,
        state_dir=tmp,
        inner=httpx.MockTransport(fake),
        **kw,  # type: ignore[arg-type]
    )
    return httpx.Client(transport=transport, base_url=GATEWAY)


def test_generation_bodies_get_the_secret_and_travel_sealed(tmp_path: Path) -> None:
    fake = FakeGateway()
    with client_for(fake, tmp_path) as client:
        resp = client.post("/v1/chat/completions", content=b'{"model":"m"}')
        assert resp.content == b'{"user_cache_secret":"' + SECRET.encode() + b'","model":"m"}'
        other = client.post("/v1/embeddings", content=b'{"model":"m"}')
        assert other.content == b'{"model":"m"}'  # sealed, but no secret off the routes
        bodyless = client.get("/v1/models")
        assert bodyless.json() == {"plaintext": True}
    assert fake.seen[-1] == b""


def test_answers_that_are_not_sealed_fail_closed_unless_they_are_errors(tmp_path: Path) -> None:
    fake = FakeGateway()
    with client_for(fake, tmp_path) as client:
        fake.answer = lambda r, p: httpx.Response(200, json={"forged": True})
        with pytest.raises(EhbpError, match="unauthenticated"):
            client.post("/v1/completions", content=b"{}")
        fake.answer = lambda r, p: httpx.Response(503, json={"error": "busy"})
        assert client.post("/v1/completions", content=b"{}").status_code == 503
        fake.answer = lambda r, p: httpx.Response(
            200, headers=[(RESPONSE_NONCE_HEADER, "00" * 32), (RESPONSE_NONCE_HEADER, "00" * 32)]
        )
        with pytest.raises(EhbpError, match="several"):
            client.post("/v1/completions", content=b"{}")
        fake.answer = lambda r, p: httpx.Response(
            200, headers={RESPONSE_NONCE_HEADER: "00" * 32}, content=b"\0\0\0\x20" + bytes(32)
        )
        with pytest.raises(EhbpError, match="authentication"):
            client.post("/v1/completions", content=b"{}")


def test_trust_on_first_use_is_recorded_announced_and_enforced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeGateway()
    with caplog.at_level(logging.WARNING, "saltgate.client"), client_for(fake, tmp_path) as c:
        assert c.post("/v1/completions", content=b"{}").status_code == 200
    assert "trusting gateway http://gw.test key sha256:" in caplog.text
    assert fake.key.config.fingerprint in caplog.text
    records = list(tmp_path.glob("gateway-*.fingerprint"))
    assert [r.read_text().strip() for r in records] == [fake.key.config.fingerprint]
    fake.key = ServerKey.generate()  # a different key at the same origin later
    with client_for(fake, tmp_path) as client, pytest.raises(GatewayKeyError, match="now offers"):
        client.post("/v1/completions", content=b"{}")


def test_pins_decide_and_are_validated(tmp_path: Path) -> None:
    fake = FakeGateway()
    with client_for(fake, tmp_path, pin=fake.key.config.fingerprint) as client:
        assert client.post("/v1/completions", content=b"{}").status_code == 200
    assert not list(tmp_path.glob("gateway-*"))  # pinned: nothing trusted on first use
    wrong = ServerKey.generate().config.fingerprint
    with (
        client_for(fake, tmp_path, pin=[wrong]) as client,
        pytest.raises(GatewayKeyError, match="not pinned"),
    ):
        client.post("/v1/completions", content=b"{}")
    with pytest.raises(ValueError, match="sha256"):
        client_for(fake, tmp_path, pin="deadbeef")


def test_only_the_configured_gateway_gets_sealed_requests(tmp_path: Path) -> None:
    fake = FakeGateway()
    with client_for(fake, tmp_path) as client, pytest.raises(GatewayKeyError, match="seals to"):
        client.post("http://elsewhere.test/v1/completions", content=b"{}")


def test_a_gateway_without_ehbp_is_a_clear_error(tmp_path: Path) -> None:
    transport = SaltgateTransport(
        GATEWAY,
        user_cache_secret=SECRET,
        state_dir=tmp_path,
        inner=httpx.MockTransport(lambda r: httpx.Response(404, json={"error": "nope"})),
    )
    with (
        httpx.Client(transport=transport, base_url=GATEWAY) as client,
        pytest.raises(GatewayKeyError, match="is EHBP enabled"),
    ):
        client.post("/v1/completions", content=b"{}")
