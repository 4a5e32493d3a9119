"""EHBP's pure core, checked against the real `tinfoil-ehbp` client as the second implementation."""

from __future__ import annotations

import os
import struct

import ehbp
import pytest
from tests.support.leaks import leaks

from saltgate.ehbp.frames import (
    KEYS_MEDIA_TYPE,
    REQUEST_FRAME_BYTES,
    EhbpError,
    KeyConfig,
    KeyConfigError,
    Keyring,
    ReplayGuard,
    ResponseOpener,
    ServerKey,
    derive_response_keys,
    frame,
    iter_frames,
    parse_hex_field,
    seal_request,
)

pytestmark = pytest.mark.unit


def tinfoil_seal(key: ServerKey, body: bytes) -> ehbp.EncryptedRequest:
    identity = ehbp.ServerIdentity.unmarshal_public_config(key.config.encode())
    sealed: ehbp.EncryptedRequest = identity.encrypt_request_body(body)
    return sealed


def frames_of(body: bytes) -> list[bytes]:
    return [frame(ct) for ct in iter_frames(body)]


def test_key_config_is_the_bytes_the_tinfoil_client_parses_and_writes() -> None:
    key = ServerKey.generate(key_id=7)
    identity = ehbp.ServerIdentity.unmarshal_public_config(key.config.encode())
    assert identity.key_id == 7
    assert identity.public_key_bytes() == key.config.public_key
    assert identity.marshal_public_config() == key.config.encode()
    assert KeyConfig.decode(key.config.encode()) == key.config
    assert KEYS_MEDIA_TYPE == ehbp.protocol.KEYS_MEDIA_TYPE
    other_suite = bytearray(key.config.encode())
    other_suite[-1] = 0x03  # ChaCha20-Poly1305
    with pytest.raises(EhbpError, match="unsupported"):
        KeyConfig.decode(bytes(other_suite))
    with pytest.raises(EhbpError, match="bytes"):
        KeyConfig.decode(key.config.encode()[:-1])


def test_the_fingerprint_covers_the_whole_config_and_the_private_key_stays_out_of_repr() -> None:
    key = ServerKey.generate()
    assert key.config.fingerprint.startswith("sha256:") and len(key.config.fingerprint) == 71
    assert KeyConfig(1, key.config.public_key).fingerprint != key.config.fingerprint
    assert not leaks(repr(key), private_key=key.private_bytes())
    assert ServerKey(key.private_bytes()).config == key.config


@pytest.mark.parametrize("size", [1, 4400, REQUEST_FRAME_BYTES, 3 * REQUEST_FRAME_BYTES + 5])
def test_bodies_sealed_by_the_tinfoil_client_open(size: int) -> None:
    key = ServerKey.generate()
    body = os.urandom(size)
    sealed = tinfoil_seal(key, body)
    opened = key.open_request(sealed.encapsulated_key, sealed.body)
    assert opened.plaintext == body
    assert len(frames_of(sealed.body)) == -(-size // REQUEST_FRAME_BYTES)
    assert opened.secret == sealed.token.exported_secret  # the same HPKE export both sides


def test_zero_length_frames_are_skipped() -> None:
    key = ServerKey.generate()
    sealed = tinfoil_seal(key, b"x" * (REQUEST_FRAME_BYTES + 1))
    parts = frames_of(sealed.body)
    empty = struct.pack(">I", 0)
    body = empty + parts[0] + empty + empty + parts[1] + empty
    assert key.open_request(sealed.encapsulated_key, body).plaintext == b"x" * (
        REQUEST_FRAME_BYTES + 1
    )


def test_responses_we_seal_open_in_the_tinfoil_client_whole_and_incrementally() -> None:
    key = ServerKey.generate()
    sealed = tinfoil_seal(key, b'{"model":"m"}')
    opened = key.open_request(sealed.encapsulated_key, sealed.body)
    nonce = os.urandom(32)
    sealer = opened.response_sealer(nonce)
    chunks = [b"data: one\n\n", b"", b"data: two\n\n", os.urandom(100_000)]
    wire = b"".join(sealer.seal(c) for c in chunks)
    assert sealed.token.decrypt_response_body(nonce, wire) == b"".join(chunks)
    decryptor = sealed.token.create_response_decryptor(nonce)
    out = [p for i in range(0, len(wire), 7) for p in decryptor.push(wire[i : i + 7])]
    decryptor.finish()
    assert out == [c for c in chunks if c]


def test_response_keys_match_the_tinfoil_derivation() -> None:
    for _ in range(20):
        secret, enc, nonce = os.urandom(32), os.urandom(32), os.urandom(32)
        ours = derive_response_keys(secret, enc, nonce)
        theirs = ehbp.derive_response_keys(secret, enc, nonce)
        assert (ours.key, ours.nonce_base) == (theirs.key, theirs.nonce_base)


def test_our_client_side_round_trips_through_the_server_side() -> None:
    key = ServerKey.generate()
    body = os.urandom(2 * REQUEST_FRAME_BYTES + 10)
    sealed = seal_request(key.config, body)
    opened = key.open_request(sealed.enc, sealed.body)
    assert opened.plaintext == body
    nonce = os.urandom(32)
    sealer = opened.response_sealer(nonce)
    wire = sealer.seal(b"hello ") + sealer.seal(b"world")
    opener = sealed.response_opener(nonce)
    assert opener.push(wire[:5]) == []  # nothing is released before its frame authenticates
    assert opener.push(wire[5:]) == [b"hello ", b"world"]
    opener.finish()


# -- tampering -----------------------------------------------------------------------------


def two_frame_request(key: ServerKey) -> tuple[bytes, list[bytes]]:
    sealed = tinfoil_seal(key, os.urandom(REQUEST_FRAME_BYTES + 100))
    return sealed.encapsulated_key, frames_of(sealed.body)


def flip(data: bytes, index: int) -> bytes:
    out = bytearray(data)
    out[index] ^= 0x01
    return bytes(out)


def test_a_flipped_byte_in_the_first_frame_is_a_key_mismatch_and_later_a_bad_frame() -> None:
    key = ServerKey.generate()
    enc, (first, second) = two_frame_request(key)
    with pytest.raises(KeyConfigError):
        key.open_request(enc, flip(first, 10) + second)
    with pytest.raises(EhbpError, match="frame 1 failed authentication") as info:
        key.open_request(enc, first + flip(second, len(second) - 1))
    assert not isinstance(info.value, KeyConfigError)


def test_replayed_reordered_and_foreign_frames_do_not_open() -> None:
    key = ServerKey.generate()
    enc, (first, second) = two_frame_request(key)
    with pytest.raises(EhbpError, match="frame 1"):
        key.open_request(enc, first + first)  # a frame replayed within the body
    with pytest.raises(EhbpError, match="frame 2"):
        key.open_request(enc, first + second + second)
    with pytest.raises(KeyConfigError):
        key.open_request(enc, second + first)
    _, (_, foreign) = two_frame_request(key)
    with pytest.raises(EhbpError, match="frame 1"):
        key.open_request(enc, first + foreign)


def test_truncated_and_oversized_frames_are_refused_before_decryption() -> None:
    key = ServerKey.generate()
    enc, (first, second) = two_frame_request(key)
    with pytest.raises(EhbpError, match="truncated"):
        key.open_request(enc, first + second[:-1])
    with pytest.raises(EhbpError, match="length prefix"):
        key.open_request(enc, first + second[:3])
    with pytest.raises(EhbpError, match="exceeds the limit"):
        key.open_request(enc, struct.pack(">I", 0xFFFFFFF0) + b"\0" * 64)
    with pytest.raises(EhbpError, match="exceeds the limit"):
        key.open_request(enc, first, max_frame_bytes=len(first) - 5)
    with pytest.raises(EhbpError, match="no frames"):
        key.open_request(enc, struct.pack(">I", 0))


def test_a_body_sealed_to_another_key_is_a_key_config_mismatch() -> None:
    sealed = tinfoil_seal(ServerKey.generate(), b'{"model":"m"}')
    with pytest.raises(KeyConfigError, match="hpke-keys"):
        ServerKey.generate().open_request(sealed.encapsulated_key, sealed.body)


def test_unusable_encapsulated_keys_are_refused() -> None:
    key = ServerKey.generate()
    with pytest.raises(EhbpError, match="64 hex digits"):
        parse_hex_field("ab" * 31, 32, "Ehbp-Encapsulated-Key")
    with pytest.raises(EhbpError, match="64 hex digits"):
        parse_hex_field("a b" + "c" * 61, 32, "Ehbp-Encapsulated-Key")
    sealed = tinfoil_seal(key, b"x")
    with pytest.raises(EhbpError, match="X25519"):  # the all-zero (low-order) point
        key.open_request(bytes(32), sealed.body)


def test_the_response_opener_refuses_tampering_and_truncation() -> None:
    key = ServerKey.generate()
    sealed = seal_request(key.config, b"{}")
    opened = key.open_request(sealed.enc, sealed.body)
    nonce = os.urandom(32)
    sealer = opened.response_sealer(nonce)
    a, b = sealer.seal(b"first"), sealer.seal(b"second")
    with pytest.raises(EhbpError, match="frame 0"):
        sealed.response_opener(nonce).push(flip(a, 6))
    with pytest.raises(EhbpError, match="frame 1"):
        sealed.response_opener(nonce).push(a + a)  # a replayed response frame
    with pytest.raises(EhbpError, match="frame 0"):
        sealed.response_opener(os.urandom(32)).push(a)  # another response's keys
    truncated = sealed.response_opener(nonce)
    assert truncated.push(a + b[:-1]) == [b"first"]
    with pytest.raises(EhbpError, match="truncated"):
        truncated.finish()
    with pytest.raises(EhbpError, match="exceeds"):
        ResponseOpener(derive_response_keys(opened.secret, sealed.enc, nonce), 10).push(a)


def test_the_replay_guard_remembers_a_bounded_window() -> None:
    guard = ReplayGuard(capacity=3)
    encs = [os.urandom(32) for _ in range(4)]
    assert all(guard.first_use(e) for e in encs[:3])
    assert not guard.first_use(encs[0])
    assert guard.first_use(encs[3])  # evicts the oldest
    assert guard.first_use(encs[0])  # the window is bounded: documented as best-effort
    assert not guard.first_use(encs[3])


def test_a_keyring_opens_under_its_current_and_retired_keys_only() -> None:
    """A rotation's overlap: bodies sealed by the tinfoil client to the old key still open
    while it is retired; once it is dropped they are a key-config mismatch (422)."""
    old, new, stranger = ServerKey.generate(), ServerKey.generate(), ServerKey.generate()
    overlap = Keyring(new, (old,))
    for key in (old, new):
        sealed = tinfoil_seal(key, b"during the overlap")
        opened = overlap.open_request(sealed.encapsulated_key, sealed.body)
        assert opened.plaintext == b"during the overlap"
    after = tinfoil_seal(old, b"after")
    with pytest.raises(KeyConfigError):
        Keyring(new).open_request(after.encapsulated_key, after.body)
    foreign = tinfoil_seal(stranger, b"x")
    with pytest.raises(KeyConfigError):
        overlap.open_request(foreign.encapsulated_key, foreign.body)
    assert "private" not in repr(overlap) and old.private_bytes().hex() not in repr(overlap)


def test_a_keyring_does_not_hide_tampering_behind_a_key_mismatch() -> None:
    """A later frame altered under the key that opened frame 0 stays a bad frame (400): the
    retired keys are tried only when the first frame opens under none."""
    old, new = ServerKey.generate(), ServerKey.generate()
    enc, (first, second) = two_frame_request(old)
    with pytest.raises(EhbpError, match="frame 1 failed authentication") as refused:
        Keyring(new, (old,)).open_request(enc, first + flip(second, len(second) - 1))
    assert not isinstance(refused.value, KeyConfigError)
