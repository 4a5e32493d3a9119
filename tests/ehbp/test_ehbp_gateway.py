"""EHBP at the gateway over loopback: the real `tinfoil-ehbp` client, tampering, the option
to refuse plaintext secrets. Nothing that fails to open may reach a replica."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import ehbp
import httpx
import orjson
import pytest
from tests.gateway.stack import MODEL, Stack, ledger_rows, long_prompt, run, stack
from tests.support.http import async_client
from tests.support.tinfoil import tinfoil_client as tinfoil
from tests.support.waiting import eventually

from saltgate.config import load_master_key
from saltgate.derivations.derive import cache_salt, derive_subkeys
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
from saltgate.sim.run import SimConfig
from saltgate.store.tenants import TenantStore

SECRET = "s3cr3t-" + "a" * 40


async def tinfoil_client(s: Stack, tenant: str = "alice") -> httpx.AsyncClient:
    """The real tinfoil-ehbp transport, with the key config the gateway serves."""
    return await tinfoil(s.url, s.keys[tenant])


def user_salt(s: Stack, tenant: str, secret: str | None) -> str:
    subkeys = derive_subkeys(load_master_key(s.state_dir / "master.key"))
    with TenantStore.from_state_dir(s.state_dir) as store:
        t = next(t for t in store.list_tenants() if t.name == tenant)
    return cache_salt(subkeys.salt, t.id, str(t.epoch), secret)


def forwarded_docs(s: Stack) -> list[dict[str, Any]]:
    return [orjson.loads(b) for b in s.seen_bodies()]


def test_the_tinfoil_client_interoperates_streaming_and_not(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            prompt = long_prompt("interop")
            async with await tinfoil_client(s) as client:
                chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}
                resp = await client.post(
                    "/v1/chat/completions",
                    json={**chat, "max_tokens": 2, "user_cache_secret": SECRET},
                )
                assert resp.status_code == 200, resp.text
                assert RESPONSE_NONCE_HEADER in resp.headers
                assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

                events = []
                async with client.stream(
                    "POST",
                    "/v1/chat/completions",
                    json={**chat, "max_tokens": 3, "stream": True, "user_cache_secret": SECRET},
                ) as stream:
                    assert stream.status_code == 200
                    events = [e async for e in stream.aiter_lines() if e.startswith("data: ")]
                assert events[-1] == "data: [DONE]"
                assert len(events) >= 4  # role, tokens..., [DONE]: delivered frame by frame

                completion = await client.post(
                    "/v1/completions",
                    json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
                )
                assert completion.status_code == 200, completion.text
            docs = forwarded_docs(s)
            assert len(docs) == 3
            assert all("user_cache_secret" not in d for d in docs)
            # the secret, sent inside EHBP, decided the namespace; without it, the tenant's
            assert docs[0]["cache_salt"] == docs[1]["cache_salt"] == user_salt(s, "alice", SECRET)
            assert docs[2]["cache_salt"] == user_salt(s, "alice", None)

    run(main)


def test_the_key_config_and_bodyless_requests_are_plaintext(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s, s.client("alice") as plain:
            resp = await plain.get(KEYS_PATH)
            assert resp.status_code == 200
            assert resp.headers["content-type"] == KEYS_MEDIA_TYPE
            assert s.gateway.ehbp is not None
            assert resp.content == s.gateway.ehbp.keyring.current.config.encode()
            async with await tinfoil_client(s) as client:
                models = await client.get("/v1/models")
            assert models.status_code == 200
            assert RESPONSE_NONCE_HEADER not in models.headers
            assert models.json()["data"]

    run(main)


def test_gateway_errors_inside_an_exchange_are_sealed_too(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s, await tinfoil_client(s) as client:
            resp = await client.post("/v1/completions", json={"model": 5, "prompt": "x"})
            assert resp.status_code == 400
            assert RESPONSE_NONCE_HEADER in resp.headers  # opened by the client: authentic
            assert resp.json()["error"]["param"] == "model"
            assert s.forwarded() == []

    run(main)


# -- tampering -----------------------------------------------------------------------------


def sealed_request(s: Stack, body: bytes) -> tuple[str, list[bytes]]:
    assert s.gateway.ehbp is not None
    identity = ehbp.ServerIdentity.unmarshal_public_config(
        s.gateway.ehbp.keyring.current.config.encode()
    )
    sealed = identity.encrypt_request_body(body)
    return sealed.encapsulated_key.hex(), [frame(c) for c in iter_frames(sealed.body)]


def two_frame_body() -> bytes:
    pad = "p" * 70_000  # two request frames
    return orjson.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1, "user": pad})


def flip(data: bytes, index: int) -> bytes:
    out = bytearray(data)
    out[index] ^= 0x80
    return bytes(out)


async def send(s: Stack, enc: str | list[str], body: bytes, **headers: str) -> httpx.Response:
    encs = enc if isinstance(enc, list) else [enc]
    pairs = [(ENCAPSULATED_KEY_HEADER, e) for e in encs] + list(headers.items())
    pairs.append(("authorization", f"Bearer {s.keys['alice']}"))
    async with async_client(base_url=s.url, timeout=30) as client:
        return await client.post("/v1/completions", content=body, headers=pairs)


def test_tampered_envelopes_get_a_clear_4xx_and_nothing_is_forwarded(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            enc, (first, second) = sealed_request(s, two_frame_body())
            cases: list[tuple[str, str | list[str], bytes, int, str]] = [
                ("flipped byte, frame 0", enc, flip(first, 20) + second, 422, ""),
                ("flipped byte, frame 1", enc, first + flip(second, 20), 400, "frame 1"),
                ("flipped tag", enc, first + flip(second, len(second) - 1), 400, "frame 1"),
                ("replayed frame", enc, first + first, 400, "frame 1"),
                ("dropped frame", enc, second, 422, ""),
                ("truncated frame", enc, first + second[:-3], 400, "truncated"),
                ("truncated prefix", enc, first + second[:2], 400, "length prefix"),
                ("oversized frame", enc, struct.pack(">I", 1 << 30) + first, 400, "exceeds"),
                ("malformed key", "zz" * 32, first + second, 400, "hex digits"),
                ("short key", enc[:-2], first + second, 400, "hex digits"),
                ("two keys", [enc, enc], first + second, 400, "exactly one"),
                ("low-order key", "00" * 32, first + second, 400, "X25519"),
            ]
            for name, e, body, status, words in cases:
                resp = await send(s, e, body)
                assert resp.status_code == status, (name, resp.text)
                assert RESPONSE_NONCE_HEADER not in resp.headers, name
                if status == 422:
                    assert resp.headers["content-type"] == "application/problem+json"
                    assert resp.json()["type"] == KEY_CONFIG_PROBLEM_TYPE
                else:
                    error = resp.json()["error"]
                    assert error["code"] == "invalid_ehbp" and words in error["message"], name
            assert s.forwarded() == []
            # positive control: the untouched envelope is accepted
            assert (await send(s, enc, first + second)).status_code == 200
            assert len(s.forwarded()) == 1

    run(main)


def test_a_replayed_request_is_refused(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            body = orjson.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1})
            enc, frames = sealed_request(s, body)
            first = await send(s, enc, b"".join(frames))
            assert first.status_code == 200 and RESPONSE_NONCE_HEADER in first.headers
            again = await send(s, enc, b"".join(frames))
            assert again.status_code == 400
            assert "replay" in again.json()["error"]["message"]
            assert len(s.forwarded()) == 1

    run(main)


def test_a_rotated_key_answers_422_and_the_tinfoil_client_says_so(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            async with await tinfoil_client(s) as stale:
                assert s.gateway.ehbp is not None
                # the operator rotates the key, keeping no overlap
                s.gateway.ehbp.keyring = Keyring(ServerKey.generate())
                with pytest.raises(ehbp.KeyConfigMismatchError):
                    await stale.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
            async with await tinfoil_client(s) as fresh:  # refetched config: works again
                ok = await fresh.post(
                    "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}
                )
                assert ok.status_code == 200
            assert len(s.forwarded()) == 1

    run(main)


def test_a_rotation_with_overlap_keeps_clients_of_the_old_key_working(tmp_path: Path) -> None:
    """docs/client-keyed.md's rotation: the new key offered, the old one retired but still
    opened, so a client holding the old key config is served; the test above is the
    control (no overlap: the same client gets the 422)."""

    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            edge = s.gateway.ehbp
            assert edge is not None
            old, new = edge.keyring.current, ServerKey.generate()
            async with await tinfoil_client(s) as stale, s.client("alice") as plain:
                edge.keyring = Keyring(new, (old,))
                offered = await plain.get(KEYS_PATH)
                assert offered.content == new.config.encode()  # only the new key is offered
                body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
                resp = await stale.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                edge.keyring = Keyring(new)  # the overlap ends
                with pytest.raises(ehbp.KeyConfigMismatchError):
                    await stale.post("/v1/completions", json=body)
            assert len(s.forwarded()) == 1

    run(main)


@pytest.mark.parametrize("required", [True, False], ids=["refuse", "control-allowed"])
def test_the_option_to_refuse_plaintext_secrets(tmp_path: Path, required: bool) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1, require_encrypted_secret=required) as s:
            body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
            async with s.client("alice") as plain:
                resp = await plain.post(
                    "/v1/completions", json={**body, "user_cache_secret": SECRET}
                )
                if required:
                    assert resp.status_code == 400
                    error = resp.json()["error"]
                    assert error["code"] == "unencrypted_user_cache_secret"
                    assert SECRET not in resp.text
                    assert s.forwarded() == []
                else:  # positive control: the same request passes when the option is off
                    assert resp.status_code == 200
                no_secret = await plain.post("/v1/completions", json=body)
                assert no_secret.status_code == 200  # the tenant-wide namespace stays open
            async with await tinfoil_client(s) as client:
                sealed = await client.post(
                    "/v1/completions", json={**body, "user_cache_secret": SECRET}
                )
                assert sealed.status_code == 200
            assert forwarded_docs(s)[-1]["cache_salt"] == user_salt(s, "alice", SECRET)

    run(main)


def test_an_oversized_encrypted_body_is_refused_by_the_size_cap(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1, max_body_bytes=64 * 1024) as s:
            enc, frames = sealed_request(s, os.urandom(100_000))
            resp = await send(s, enc, b"".join(frames))
            assert resp.status_code == 413
            assert s.forwarded() == []

    run(main)


def test_an_encrypted_request_whose_client_left_is_still_metered(tmp_path: Path) -> None:
    """The sealing wraps the exchange's stream; closing it unread must close the exchange,
    which then meters the replica's usage (status 499)."""

    async def main() -> None:
        # Slow enough between every event (100 ms) that a client reading with a 50 ms
        # timeout leaves mid-stream even when its loop is starved for a while: with 2 ms
        # per token a busy machine let it read the whole answer (a 200) once in four runs.
        slow = SimConfig(port=0, prefill_ms_per_1k_tokens=100.0, decode_ms_per_token=100.0)
        async with stack(tmp_path, replicas=1, sim=slow) as s:
            doc = {"model": MODEL, "prompt": long_prompt("sealed", 2000), "max_tokens": 20}
            enc, frames = sealed_request(s, orjson.dumps({**doc, "stream": True}))
            with pytest.raises(httpx.ReadTimeout):
                read_only = httpx.Timeout(10, read=0.05)  # a slow connect is no leaving
                async with async_client(base_url=s.url, timeout=read_only) as client:
                    await client.post(
                        "/v1/completions",
                        content=b"".join(frames),
                        headers={
                            ENCAPSULATED_KEY_HEADER: enc,
                            "authorization": f"Bearer {s.keys['alice']}",
                        },
                    )
            await eventually(lambda: bool(ledger_rows(s)), what="the usage is recorded")
            rows = ledger_rows(s)
            assert [(r["status"], r["completion_tokens"]) for r in rows] == [(499, 20)]
            assert rows[0]["prompt_tokens"] > 2000

    run(main)
