"""EHBP at the gateway's edge: open encrypted request bodies before the gateway sees them,
seal whatever it answers, frame by frame.

It wraps the gateway's handler, so the request path (auth, policy, salt, forward) is the
same for encrypted and plaintext requests; the handler only learns that the body arrived
encrypted (for `require_encrypted_secret`). An envelope that does not open is answered
here and nothing is forwarded: 422 problem+json for a body sealed to another key (the
client refetches the key config and resends), 400 in OpenAI's error shape otherwise.
Bodyless requests and requests without `Ehbp-Encapsulated-Key` pass through in plaintext.
The opening (`EhbpOpener`) is shared with the EPP (saltgate/epp), which seals the answer
Envoy relays chunk by chunk with the same `Opened.sealer`.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import orjson

from saltgate.config import ConfigError, create_secret_file, read_secret_file
from saltgate.derivations.derive import SECRET_FIELD
from saltgate.ehbp.frames import (
    ENCAPSULATED_KEY_HEADER,
    KEYS_MEDIA_TYPE,
    KEYS_PATH,
    PROBLEM_MEDIA_TYPE,
    PUBLIC_KEY_BYTES,
    RESPONSE_NONCE_BYTES,
    RESPONSE_NONCE_HEADER,
    EhbpError,
    KeyConfigError,
    Keyring,
    OpenedRequest,
    ReplayGuard,
    ResponseSealer,
    ServerKey,
    parse_hex_field,
    problem_json,
)
from saltgate.gateway.metrics import Metrics
from saltgate.http import Request, Response
from saltgate.policy.errors import ApiError

# The gateway's handler, told whether the body arrived encrypted.
BodyHandler = Callable[[Request, bool], Awaitable[Response]]

_ENC_HEADER: Final = ENCAPSULATED_KEY_HEADER.lower().encode()
_NONCE_HEADER: Final = RESPONSE_NONCE_HEADER.lower().encode()
_KEYS_PATH: Final = KEYS_PATH.encode()
# Framing of the encrypted body; the opened body gets its own.
_DROPPED_REQUEST_HEADERS: Final = frozenset({_ENC_HEADER, b"content-length", b"transfer-encoding"})
_OUTCOMES: Final = "saltgate_ehbp_requests_total"


def plaintext_secret_refused() -> ApiError:
    """400 for `require_encrypted_secret`: the secret must travel inside an EHBP body."""
    return ApiError(
        400,
        f"This gateway accepts '{SECRET_FIELD}' only inside an EHBP-encrypted body (the "
        "operator could read it otherwise); use the saltgate client SDK or `saltgate proxy`, "
        "or omit the field to use the tenant-wide cache.",
        param=SECRET_FIELD,
        code="unencrypted_user_cache_secret",
    )


@dataclass(frozen=True, slots=True)
class Opened:
    """An EHBP request opened: the plaintext request the gateway's policy sees (the
    envelope's framing headers dropped) and what seals its answer."""

    request: Request
    sealing: OpenedRequest

    def sealer(self) -> tuple[tuple[bytes, bytes], ResponseSealer]:
        """A fresh response nonce's header, and the sealer its answer's frames use."""
        nonce = secrets.token_bytes(RESPONSE_NONCE_BYTES)
        return (_NONCE_HEADER, nonce.hex().encode()), self.sealing.response_sealer(nonce)


class EhbpOpener:
    """The keys, the replay guard and the outcome count: what serves the key config and
    opens encrypted requests, for the gateway's edge and for the EPP (saltgate/epp) alike.
    `keyring` may be replaced to rotate."""

    def __init__(
        self, keyring: Keyring, metrics: Metrics, *, replay: ReplayGuard | None = None
    ) -> None:
        self.keyring = keyring
        self.metrics = metrics
        self.replay = replay or ReplayGuard()
        metrics.describe(_OUTCOMES, "counter", "EHBP-encrypted requests by outcome.")

    def key_config(self, request: Request) -> Response | None:
        """The answer to `GET /.well-known/hpke-keys` (the key clients seal to); None for
        any other request."""
        if request.path != _KEYS_PATH or request.method != b"GET":
            return None
        return Response(
            200,
            [(b"content-type", KEYS_MEDIA_TYPE.encode()), (b"cache-control", b"no-cache")],
            self.keyring.current.config.encode(),
        )

    def open(self, request: Request) -> Opened | Response | None:
        """The request opened; None for a plaintext one (bodyless, or without
        `Ehbp-Encapsulated-Key`); the refusal, in plaintext, for an envelope that does not
        open: 422 problem+json for another key, 400 otherwise."""
        values = [v for n, v in request.headers if n == _ENC_HEADER]
        if not values or not request.body:
            return None
        try:
            if len(values) > 1:
                raise EhbpError(f"send exactly one {ENCAPSULATED_KEY_HEADER} header")
            enc = parse_hex_field(values[0], PUBLIC_KEY_BYTES, ENCAPSULATED_KEY_HEADER)
            opened = self.keyring.open_request(enc, request.body)
            if not self.replay.first_use(enc):
                raise EhbpError("this encrypted request was already received (replay)")
        except KeyConfigError as other_key:
            self._count("key_config")
            return Response(
                422,
                [(b"content-type", PROBLEM_MEDIA_TYPE.encode())],
                orjson.dumps(problem_json(str(other_key))),
            )
        except EhbpError as exc:
            self._count("rejected")
            error = ApiError(400, f"Invalid EHBP request: {exc}.", code="invalid_ehbp")
            return Response(400, [(b"content-type", b"application/json")], error.body())
        self._count("opened")
        inner = Request(
            request.method,
            request.path,
            request.query,
            [(n, v) for n, v in request.headers if n not in _DROPPED_REQUEST_HEADERS],
            opened.plaintext,
            request.client,
        )
        return Opened(inner, opened)

    def _count(self, outcome: str) -> None:
        self.metrics.inc(_OUTCOMES, (("outcome", outcome),))


class EhbpEdge(EhbpOpener):
    """The HTTP server's handler when EHBP is on."""

    def __init__(
        self,
        handle: BodyHandler,
        keyring: Keyring,
        metrics: Metrics,
        *,
        replay: ReplayGuard | None = None,
    ) -> None:
        super().__init__(keyring, metrics, replay=replay)
        self._handle = handle

    async def handle(self, request: Request) -> Response:
        keys = self.key_config(request)
        if keys is not None:
            return keys
        opened = self.open(request)
        if opened is None:
            return await self._handle(request, False)
        if isinstance(opened, Response):
            return opened
        response = await self._handle(opened.request, True)
        nonce, sealer = opened.sealer()
        headers = [(n, v) for n, v in response.headers if n != b"content-length"]
        headers.append(nonce)
        return Response(response.status, headers, stream=_Sealed(response, sealer))


class _Sealed:
    """The response body as frames: one per chunk the gateway produces, as it produces it.

    Closing it closes the body it seals, even if no frame was asked for (the client left
    before the answer): that body may be an exchange that must still meter itself.
    """

    __slots__ = ("_body", "_inner", "_sealer")

    def __init__(self, response: Response, sealer: ResponseSealer) -> None:
        self._inner = response.stream
        self._body = response.body
        self._sealer = sealer

    def __aiter__(self) -> _Sealed:
        return self

    async def __anext__(self) -> bytes:
        inner = self._inner
        if inner is None:
            body, self._body = self._body, b""
            if not body:
                raise StopAsyncIteration
            return self._sealer.seal(body)
        while not (chunk := await inner.__anext__()):
            pass
        return self._sealer.seal(chunk)

    async def aclose(self) -> None:
        if self._inner is not None:
            await self._inner.aclose()


def load_or_create_server_key(path: Path) -> ServerKey:
    """The operator's HPKE key file (hex of 32 bytes, mode 0600); made if absent.

    Read like every secret file (config.read_secret_file: no symlink, no file others can
    read). The key's bytes never appear in an error.
    """
    create_secret_file(path, "EHBP key file", ServerKey.generate().private_bytes().hex() + "\n")
    return load_server_key(path)


def load_server_key(path: Path) -> ServerKey:
    """The key in an existing key file (`saltgate serve --check` reads it, makes none)."""
    data = read_secret_file(path, "EHBP key file")
    raw = b""
    with contextlib.suppress(ValueError, UnicodeDecodeError):
        raw = bytes.fromhex(data.decode().strip())
    if len(raw) != PUBLIC_KEY_BYTES:
        raise ConfigError(
            f"EHBP key file {path} must hold {2 * PUBLIC_KEY_BYTES} hex digits (an X25519 key)"
        )
    return ServerKey(raw)


def load_retired_keys(current: ServerKey | None, paths: Sequence[Path]) -> tuple[ServerKey, ...]:
    """The keys a rotation replaced (`[ehbp] retired_key_files`), opened but not offered.

    They must exist (never made: a new key there would open nothing), and none may be the
    current key again, the sign of a rotation written the wrong way round.
    """
    retired = tuple(load_server_key(path) for path in paths)
    for path, key in zip(paths, retired, strict=True):
        if current is not None and key.config == current.config:
            raise ConfigError(
                f"ehbp.retired_key_files: {path} holds the current key (ehbp.key_file); a "
                "rotation lists the old key there and the new one as key_file"
            )
    return retired
