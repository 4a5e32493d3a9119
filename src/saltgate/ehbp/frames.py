"""EHBP, Tinfoil's Encrypted HTTP Body Protocol, as pure functions and small state objects.

Wire-compatible with the `tinfoil-ehbp` clients (their SPEC.md): HPKE base mode
DHKEM(X25519, HKDF-SHA256) / HKDF-SHA256 / AES-256-GCM with info "ehbp request"; a body is
a sequence of frames `u32be(len) || ciphertext` sealed in order on one HPKE context (empty
AAD; zero-length frames are skipped). The response is sealed with AES-256-GCM under keys
bound to the request: secret = Export("ehbp response", 32), then HKDF with salt
enc || response_nonce gives key ("key", 32) and base nonce ("nonce", 12); frame i uses
base_nonce XOR i. The crypto is pyhpke's and cryptography's; nothing here does I/O, so the
gateway edge and the client SDK share it and tests run it without sockets.
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)
from pyhpke import AEADId, CipherSuite, KDFId, KEMId

ENCAPSULATED_KEY_HEADER: Final = "Ehbp-Encapsulated-Key"
RESPONSE_NONCE_HEADER: Final = "Ehbp-Response-Nonce"
KEYS_PATH: Final = "/.well-known/hpke-keys"
KEYS_MEDIA_TYPE: Final = "application/ohttp-keys"
PROBLEM_MEDIA_TYPE: Final = "application/problem+json"
KEY_CONFIG_PROBLEM_TYPE: Final = "urn:ietf:params:ehbp:error:key-config"

KEM_X25519_HKDF_SHA256: Final = 0x0020
KDF_HKDF_SHA256: Final = 0x0001
AEAD_AES_256_GCM: Final = 0x0002
REQUEST_INFO: Final = b"ehbp request"
EXPORT_LABEL: Final = b"ehbp response"

PUBLIC_KEY_BYTES: Final = 32  # X25519; also the length of `enc`
RESPONSE_NONCE_BYTES: Final = 32  # max(Nn, Nk) for AES-256-GCM, as in OHTTP
SECRET_BYTES: Final = 32
AEAD_NONCE_BYTES: Final = 12
TAG_BYTES: Final = 16
LENGTH_PREFIX_BYTES: Final = 4
# Plaintext per request frame when we seal (the tinfoil clients use the same size).
REQUEST_FRAME_BYTES: Final = 64 * 1024
# Largest frame (ciphertext) we open, either direction. Clients frame at 8..64 KiB; the
# limit is checked on the length prefix, before anything is buffered or decrypted.
MAX_FRAME_BYTES: Final = 1024 * 1024

_SUITE: Final = CipherSuite.new(
    KEMId.DHKEM_X25519_HKDF_SHA256, KDFId.HKDF_SHA256, AEADId.AES256_GCM
)
_CONFIG_BYTES: Final = 1 + 2 + PUBLIC_KEY_BYTES + 2 + 4
_HEX_DIGITS: Final = frozenset("0123456789abcdefABCDEF")


class EhbpError(ValueError):
    """A body or header that cannot be opened. The message names what is wrong, never a key."""


class KeyConfigError(EhbpError):
    """The request was sealed to a key this gateway does not hold (stale or rotated key).

    Answered with 422 and the protocol's problem+json type, so clients refetch the key
    config and resend (SPEC 5.4.3).
    """


# -- key configuration (RFC 9458 section 3.1) --------------------------------------------


@dataclass(frozen=True, slots=True)
class KeyConfig:
    """The public half a client needs: key id, KEM, public key, one cipher suite."""

    key_id: int
    public_key: bytes

    def encode(self) -> bytes:
        """`key_id(1) kem_id(2) public_key(32) suites_len(2) kdf_id(2) aead_id(2)`.

        One bare key_config, as every EHBP client parses it (no RFC 9458 section 3.2
        length prefix).
        """
        return struct.pack(
            f">BH{PUBLIC_KEY_BYTES}sHHH",
            self.key_id,
            KEM_X25519_HKDF_SHA256,
            self.public_key,
            4,
            KDF_HKDF_SHA256,
            AEAD_AES_256_GCM,
        )

    @classmethod
    def decode(cls, data: bytes) -> KeyConfig:
        """Parse one key_config; anything but our single suite is refused."""
        if len(data) != _CONFIG_BYTES:
            raise EhbpError(f"key config must be {_CONFIG_BYTES} bytes, got {len(data)}")
        key_id, kem, public_key, suites_len, kdf, aead = struct.unpack(
            f">BH{PUBLIC_KEY_BYTES}sHHH", data
        )
        if (kem, suites_len, kdf, aead) != (
            KEM_X25519_HKDF_SHA256,
            4,
            KDF_HKDF_SHA256,
            AEAD_AES_256_GCM,
        ):
            raise EhbpError("key config names an unsupported HPKE suite")
        return cls(key_id, public_key)

    @property
    def fingerprint(self) -> str:
        """What a client pins: SHA-256 over the whole key config (id, suite and key)."""
        return "sha256:" + hashlib.sha256(self.encode()).hexdigest()


class ServerKey:
    """The gateway's HPKE key pair. The private half never leaves this object except
    through `private_bytes()`, which exists to write the operator's key file."""

    __slots__ = ("_private", "_raw", "config")

    def __init__(self, private_bytes: bytes, key_id: int = 0) -> None:
        if len(private_bytes) != PUBLIC_KEY_BYTES:
            raise EhbpError(f"an X25519 private key is {PUBLIC_KEY_BYTES} bytes")
        public = (
            X25519PrivateKey.from_private_bytes(private_bytes)
            .public_key()
            .public_bytes(Encoding.Raw, PublicFormat.Raw)
        )
        self._raw = bytes(private_bytes)
        self._private = _SUITE.kem.deserialize_private_key(self._raw)
        self.config = KeyConfig(key_id, public)

    @classmethod
    def generate(cls, key_id: int = 0) -> ServerKey:
        raw = X25519PrivateKey.generate().private_bytes(
            Encoding.Raw, PrivateFormat.Raw, NoEncryption()
        )
        return cls(raw, key_id)

    def private_bytes(self) -> bytes:
        return self._raw

    def __repr__(self) -> str:
        return f"ServerKey(key_id={self.config.key_id}, {self.config.fingerprint})"

    def open_request(
        self, enc: bytes, body: bytes, *, max_frame_bytes: int = MAX_FRAME_BYTES
    ) -> OpenedRequest:
        """Open a whole encrypted request body, or raise without returning any plaintext.

        A first frame that fails to open means the client sealed to another key (the
        SPEC's key-config mismatch, 422); a later one means tampering (400).
        """
        try:
            context = _SUITE.create_recipient_context(enc, self._private, info=REQUEST_INFO)
        except Exception:
            raise EhbpError("Ehbp-Encapsulated-Key is not a usable X25519 public key") from None
        parts: list[bytes] = []
        for index, ciphertext in enumerate(iter_frames(body, max_frame_bytes)):
            try:
                parts.append(context.open(ciphertext, b""))
            except Exception:
                if index == 0:
                    raise KeyConfigError(
                        "the request body does not open under this gateway's key; fetch "
                        f"{KEYS_PATH} and resend"
                    ) from None
                raise EhbpError(
                    f"encrypted frame {index} failed authentication (altered, reordered or "
                    "replayed)"
                ) from None
        if not parts:
            raise EhbpError("the encrypted body holds no frames")
        secret = context.export(EXPORT_LABEL, SECRET_BYTES)
        return OpenedRequest(b"".join(parts), enc, secret)


class Keyring:
    """The key the gateway offers and the retired keys it still opens during a rotation.

    Clients that fetched the key config before a rotation keep sealing to the old key, and
    pinned clients move to the new fingerprint one by one; while both are held, a request
    opens under either, so no client breaks mid-rotation. Only `current` is offered.
    """

    __slots__ = ("current", "retired")

    def __init__(self, current: ServerKey, retired: tuple[ServerKey, ...] = ()) -> None:
        self.current = current
        self.retired = retired

    def __repr__(self) -> str:
        return f"Keyring(current={self.current!r}, retired={len(self.retired)})"

    def open_request(
        self, enc: bytes, body: bytes, *, max_frame_bytes: int = MAX_FRAME_BYTES
    ) -> OpenedRequest:
        """Open under the current key, else under each retired one; KeyConfigError only
        when none holds the key the request was sealed to."""
        try:
            return self.current.open_request(enc, body, max_frame_bytes=max_frame_bytes)
        except KeyConfigError:
            for key in self.retired:
                with contextlib.suppress(KeyConfigError):
                    return key.open_request(enc, body, max_frame_bytes=max_frame_bytes)
            raise


# -- framing ------------------------------------------------------------------------------


def frame(ciphertext: bytes) -> bytes:
    return struct.pack(">I", len(ciphertext)) + ciphertext


def iter_frames(body: bytes, max_frame_bytes: int = MAX_FRAME_BYTES) -> Iterator[bytes]:
    """The ciphertexts of a complete framed body; raises on truncation or oversize."""
    view = memoryview(body)
    offset = 0
    while offset < len(view):
        if len(view) - offset < LENGTH_PREFIX_BYTES:
            raise EhbpError("the encrypted body ends inside a frame's length prefix")
        (length,) = struct.unpack_from(">I", view, offset)
        offset += LENGTH_PREFIX_BYTES
        if length > max_frame_bytes:
            raise EhbpError(
                f"an encrypted frame of {length} bytes exceeds the limit of {max_frame_bytes} bytes"
            )
        if length == 0:
            continue
        if len(view) - offset < length:
            raise EhbpError("the encrypted body ends inside a frame (truncated)")
        yield bytes(view[offset : offset + length])
        offset += length


def parse_hex_field(value: bytes | str, size: int, name: str) -> bytes:
    """Strict hex of exactly `size` bytes (bytes.fromhex alone would skip whitespace)."""
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    if len(text) != 2 * size or not set(text) <= _HEX_DIGITS:
        raise EhbpError(f"{name} must be {2 * size} hex digits")
    return bytes.fromhex(text)


# -- responses ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResponseKeys:
    key: bytes = field(repr=False)
    nonce_base: bytes = field(repr=False)


def derive_response_keys(secret: bytes, enc: bytes, response_nonce: bytes) -> ResponseKeys:
    """OHTTP's response key schedule with EHBP's labels (SPEC 4.4)."""
    salt = enc + response_nonce

    def expand(info: bytes, length: int) -> bytes:
        return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(secret)

    return ResponseKeys(expand(b"key", 32), expand(b"nonce", AEAD_NONCE_BYTES))


def _chunk_nonce(base: bytes, seq: int) -> bytes:
    return (int.from_bytes(base, "big") ^ seq).to_bytes(AEAD_NONCE_BYTES, "big")


class ResponseSealer:
    """Seals response chunks in order, one frame per chunk (so streams stay streams)."""

    __slots__ = ("_aead", "_base", "_seq")

    def __init__(self, keys: ResponseKeys) -> None:
        self._aead = AESGCM(keys.key)
        self._base = keys.nonce_base
        self._seq = 0

    def seal(self, plaintext: bytes) -> bytes:
        if not plaintext:
            return b""
        ciphertext = self._aead.encrypt(_chunk_nonce(self._base, self._seq), plaintext, b"")
        self._seq += 1
        return frame(ciphertext)


class ResponseOpener:
    """Opens a framed response as bytes arrive; a chunk is released only once authenticated."""

    __slots__ = ("_aead", "_base", "_buffer", "_max", "_seq")

    def __init__(self, keys: ResponseKeys, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._aead = AESGCM(keys.key)
        self._base = keys.nonce_base
        self._buffer = bytearray()
        self._seq = 0
        self._max = max_frame_bytes

    def push(self, data: bytes) -> list[bytes]:
        self._buffer += data
        out: list[bytes] = []
        while len(self._buffer) >= LENGTH_PREFIX_BYTES:
            (length,) = struct.unpack_from(">I", self._buffer, 0)
            if length > self._max:
                raise EhbpError(f"a response frame of {length} bytes exceeds {self._max}")
            if len(self._buffer) < LENGTH_PREFIX_BYTES + length:
                break
            ciphertext = bytes(self._buffer[LENGTH_PREFIX_BYTES : LENGTH_PREFIX_BYTES + length])
            del self._buffer[: LENGTH_PREFIX_BYTES + length]
            if not ciphertext:
                continue
            try:
                out.append(self._aead.decrypt(_chunk_nonce(self._base, self._seq), ciphertext, b""))
            except Exception:
                raise EhbpError(f"response frame {self._seq} failed authentication") from None
            self._seq += 1
        return out

    def finish(self) -> None:
        if self._buffer:
            raise EhbpError("the encrypted response ends inside a frame (truncated)")


@dataclass(frozen=True, slots=True)
class OpenedRequest:
    """A request body opened by the gateway, and what it needs to seal the answer."""

    plaintext: bytes = field(repr=False)
    enc: bytes
    secret: bytes = field(repr=False)

    def response_sealer(self, response_nonce: bytes) -> ResponseSealer:
        return ResponseSealer(derive_response_keys(self.secret, self.enc, response_nonce))


@dataclass(frozen=True, slots=True)
class SealedRequest:
    """A request body sealed by a client, and what it needs to open the answer."""

    enc: bytes
    body: bytes
    secret: bytes = field(repr=False)

    def response_opener(self, response_nonce: bytes) -> ResponseOpener:
        return ResponseOpener(derive_response_keys(self.secret, self.enc, response_nonce))


def seal_request(
    config: KeyConfig, plaintext: bytes, frame_bytes: int = REQUEST_FRAME_BYTES
) -> SealedRequest:
    """The client side: a fresh HPKE context per request, `frame_bytes` of plaintext a frame."""
    public = _SUITE.kem.deserialize_public_key(config.public_key)
    enc, context = _SUITE.create_sender_context(public, info=REQUEST_INFO)
    frames = [
        frame(context.seal(plaintext[i : i + frame_bytes], b""))
        for i in range(0, len(plaintext), frame_bytes)
    ]
    return SealedRequest(bytes(enc), b"".join(frames), context.export(EXPORT_LABEL, SECRET_BYTES))


# -- replay --------------------------------------------------------------------------------


class ReplayGuard:
    """Remembers the `enc` of the last `capacity` opened requests and refuses a repeat.

    A legitimate client never reuses one (a fresh ephemeral key per request), so a repeat
    is someone resending a captured request: it could not read the answer, but it would
    run the user's prompt in the user's namespace again. Per process and bounded: a
    best-effort window, documented in docs/client-keyed.md.
    """

    __slots__ = ("_capacity", "_seen")

    def __init__(self, capacity: int = 65536) -> None:
        self._capacity = capacity
        self._seen: dict[bytes, None] = {}

    def first_use(self, enc: bytes) -> bool:
        if enc in self._seen:
            return False
        self._seen[enc] = None
        if len(self._seen) > self._capacity:
            del self._seen[next(iter(self._seen))]
        return True


def problem_json(title: str) -> dict[str, Any]:
    """The 422 body the protocol defines for a key-configuration mismatch."""
    return {"type": KEY_CONFIG_PROBLEM_TYPE, "title": title}
