"""EHBP through Envoy and the EPP, with the real `tinfoil-ehbp` client: the EPP opens the
sealed body with the gateway's keyring (gateway/ehbp.py's `EhbpOpener`, the edge's own),
the replica gets the salted plaintext, and the answer comes back sealed, whole or frame by
frame. Envelopes that do not open get the gateway's 400 / 422 and reach no replica.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import ehbp
import httpx
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from tests.epp.test_through_envoy import MODEL, EnvoyStack, envoy_stack, ledger_rows_of
from tests.gateway.stack import long_prompt, run
from tests.support.http import async_client
from tests.support.tinfoil import tinfoil_client as tinfoil

from saltgate.ehbp.frames import (
    ENCAPSULATED_KEY_HEADER,
    KEY_CONFIG_PROBLEM_TYPE,
    KEYS_MEDIA_TYPE,
    KEYS_PATH,
    RESPONSE_NONCE_HEADER,
    Keyring,
    ServerKey,
    frame,
    iter_frames,
)
from saltgate.epp import server as epp_server
from saltgate.gateway.ehbp import EhbpOpener

SECRET = "s3cr3t-" + "b" * 40


async def tinfoil_client(s: EnvoyStack, tenant: str = "alice") -> httpx.AsyncClient:
    """The real tinfoil-ehbp transport, its key config fetched through Envoy."""
    return await tinfoil(s.url, s.keys[tenant])


def opener(s: EnvoyStack) -> EhbpOpener:
    assert s.epp.ehbp is not None
    return s.epp.ehbp


def forwarded(s: EnvoyStack) -> list[bytes]:
    """The bodies of the requests the replicas received (probes left out)."""
    return [r.body for tap in s.taps for r in tap.seen if r.method == b"POST"]


CHAT: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": long_prompt("sealed")}],
    "max_tokens": 4,
}


async def sealed_chats(s: EnvoyStack) -> tuple[str, str]:
    """A sealed chat completion, whole and streamed, through Envoy: each an answer the
    client opened, the replica given the salt derived from the sealed `user_cache_secret`
    and neither the client's salt, nor the secret, nor the envelope; the answers' texts.
    Raises AssertionError otherwise."""
    chat = {**CHAT, "user_cache_secret": SECRET, "cache_salt": "the-clients-own"}
    async with await tinfoil_client(s) as client:
        whole = await client.post("/v1/chat/completions", json=chat)
        assert whole.status_code == 200, whole.text
        assert RESPONSE_NONCE_HEADER in whole.headers  # the client opened a sealed answer
        answer = whole.json()
        assert answer["usage"]["completion_tokens"] == 4
        async with client.stream(
            "POST", "/v1/chat/completions", json={**chat, "stream": True}
        ) as stream:
            assert stream.status_code == 200
            assert RESPONSE_NONCE_HEADER in stream.headers
            events = [e async for e in stream.aiter_lines() if e.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        deltas = [orjson.loads(e[6:])["choices"][0]["delta"] for e in events[:-1]]
        tokens = [d["content"] for d in deltas if d.get("content")]
        assert len(tokens) == 4  # delivered as events, one a token
    bodies = forwarded(s)
    assert len(bodies) == 2
    for raw in bodies:
        doc = orjson.loads(raw)  # plaintext JSON, not the envelope
        assert doc["cache_salt"] == s.salt("alice", SECRET)
        assert "user_cache_secret" not in doc
        assert b"the-clients-own" not in raw and SECRET.encode() not in raw
    for tap in s.taps:
        for request in tap.seen:
            assert request.header(ENCAPSULATED_KEY_HEADER.lower().encode()) is None
    return str(answer["choices"][0]["message"]["content"]), "".join(tokens)


def test_a_sealed_chat_completion_through_envoy_whole_and_streamed(tmp_path: Path) -> None:
    async def body() -> None:
        async with envoy_stack(tmp_path) as s:
            async with async_client(base_url=s.url, timeout=30) as plain:
                offered = await plain.get(KEYS_PATH)  # served through Envoy, by the EPP
            assert offered.status_code == 200
            assert offered.headers["content-type"] == KEYS_MEDIA_TYPE
            assert offered.content == opener(s).keyring.current.config.encode()
            whole, streamed = await sealed_chats(s)
            rows = ledger_rows_of(s)
            assert [(r["status"], r["completion_tokens"]) for r in rows] == [(200, 4)] * 2
            async with s.client("alice") as plain:  # the same question in plaintext
                expected = (await plain.post("/v1/chat/completions", json=CHAT)).json()
            assert whole == streamed == expected["choices"][0]["message"]["content"]
            async with await tinfoil_client(s) as client:  # the EPP's own refusals: sealed
                refused = await client.post("/v1/completions", json={"model": 5, "prompt": "x"})
                assert refused.status_code == 400
                assert RESPONSE_NONCE_HEADER in refused.headers
                assert refused.json()["error"]["param"] == "model"
            assert len(forwarded(s)) == 3

    run(body)


def test_positive_control_an_epp_forwarding_the_sealed_body_unopened_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checks above, against an EPP that lets an EHBP body through as it came (to
    the first replica, envelope and all): they fail."""
    plain_request = epp_server._Conversation._request

    async def unopened(
        self: epp_server._Conversation, body: bytes, *, headers_phase: bool
    ) -> ext.ProcessingResponse:
        if not any(k == ENCAPSULATED_KEY_HEADER.lower().encode() for k, _ in self.headers):
            return await plain_request(self, body, headers_phase=headers_phase)
        first = epp_server.endpoint(self.gateway.replicas.replicas[0].config.url)
        kept = [(k, v) for k, v in self.headers if not k.startswith(b":") and k != b"host"]
        return epp_server.destination(
            self.headers, kept, body, [first], headers_phase=headers_phase
        )

    monkeypatch.setattr(epp_server._Conversation, "_request", unopened)

    async def body() -> None:
        async with envoy_stack(tmp_path) as s:
            with pytest.raises(AssertionError):
                await sealed_chats(s)
            assert forwarded(s)  # it did reach the replica: sealed, unsalted
            assert all(not r.startswith(b"{") for r in forwarded(s))

    run(body)


def sealed_request(s: EnvoyStack, body: bytes) -> tuple[str, list[bytes]]:
    """``body`` sealed to the key the EPP offers: `enc` in hex and the frames."""
    config = opener(s).keyring.current.config.encode()
    sealed = ehbp.ServerIdentity.unmarshal_public_config(config).encrypt_request_body(body)
    return sealed.encapsulated_key.hex(), [frame(c) for c in iter_frames(sealed.body)]


def flip(data: bytes, index: int) -> bytes:
    out = bytearray(data)
    out[index] ^= 0x80
    return bytes(out)


async def send(s: EnvoyStack, enc: str, body: bytes) -> httpx.Response:
    headers = {ENCAPSULATED_KEY_HEADER: enc, "authorization": f"Bearer {s.keys['alice']}"}
    async with async_client(base_url=s.url, timeout=30) as client:
        return await client.post("/v1/completions", content=body, headers=headers)


def test_tampered_replayed_and_other_key_envelopes_get_the_gateways_answers(
    tmp_path: Path,
) -> None:
    """As tests/ehbp/test_ehbp_gateway.py at the gateway: a tampered body 400
    (`invalid_ehbp`), a body sealed to a key the EPP does not hold 422 problem+json (the
    tinfoil client raises KeyConfigMismatchError), a replay 400; a retired key still held
    opens; none of the refused reaches a replica."""

    async def body() -> None:
        async with envoy_stack(tmp_path) as s:
            pad = "p" * 70_000  # two request frames
            doc = {"model": MODEL, "prompt": "x", "max_tokens": 1, "user": pad}
            enc, (first, second) = sealed_request(s, orjson.dumps(doc))
            cases = [
                ("flipped byte, frame 1", first + flip(second, 20), 400, "frame 1"),
                ("truncated frame", first + second[:-3], 400, "truncated"),
                ("oversized frame", struct.pack(">I", 1 << 30) + first, 400, "exceeds"),
                ("flipped byte, frame 0", flip(first, 20) + second, 422, ""),
            ]
            for name, sealed, status, words in cases:
                answer = await send(s, enc, sealed)
                assert answer.status_code == status, (name, answer.text)
                assert RESPONSE_NONCE_HEADER not in answer.headers, name
                if status == 422:
                    assert answer.headers["content-type"] == "application/problem+json"
                    assert answer.json()["type"] == KEY_CONFIG_PROBLEM_TYPE
                else:
                    error = answer.json()["error"]
                    assert error["code"] == "invalid_ehbp" and words in error["message"], name
            assert forwarded(s) == []
            intact = await send(s, enc, first + second)  # the control: the same, untouched
            assert intact.status_code == 200, intact.text
            assert RESPONSE_NONCE_HEADER in intact.headers
            replayed = await send(s, enc, first + second)
            assert replayed.status_code == 400
            assert "replay" in replayed.json()["error"]["message"]
            assert len(forwarded(s)) == 1

            edge, request = opener(s), {"model": MODEL, "prompt": "x", "max_tokens": 1}
            old = edge.keyring.current
            async with await tinfoil_client(s) as stale:
                edge.keyring = Keyring(ServerKey.generate(), (old,))  # rotated, old retired
                assert (await stale.post("/v1/completions", json=request)).status_code == 200
                edge.keyring = Keyring(edge.keyring.current)  # the overlap ends
                with pytest.raises(ehbp.KeyConfigMismatchError):
                    await stale.post("/v1/completions", json=request)
            async with await tinfoil_client(s) as fresh:  # the new key config: served again
                assert (await fresh.post("/v1/completions", json=request)).status_code == 200
            assert len(forwarded(s)) == 3

    run(body)


def test_require_encrypted_secret_holds_through_envoy(tmp_path: Path) -> None:
    """`[ehbp] require_encrypted_secret`: a `user_cache_secret` in plaintext is refused
    and reaches no replica; the same request sealed passes (the EPP tells the policy the
    body came encrypted, as the gateway's edge does) and decides the namespace."""

    async def body() -> None:
        sections = "[ehbp]\nrequire_encrypted_secret = true\n"
        async with envoy_stack(tmp_path, sections=sections) as s:
            chat = {**CHAT, "user_cache_secret": SECRET}
            async with s.client("alice") as plain:
                refused = await plain.post("/v1/chat/completions", json=chat)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["code"] == "unencrypted_user_cache_secret"
            assert forwarded(s) == []
            async with await tinfoil_client(s) as client:
                sealed = await client.post("/v1/chat/completions", json=chat)
            assert sealed.status_code == 200, sealed.text
            [sent] = forwarded(s)
            assert orjson.loads(sent)["cache_salt"] == s.salt("alice", SECRET)

    run(body)
