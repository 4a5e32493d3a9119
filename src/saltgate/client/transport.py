"""httpx transports for client-keyed mode: splice the user's secret in, then seal with EHBP.

Every request with a body is sealed to the gateway's HPKE key (the operator sees headers
and sizes, never the body); POSTs to the generation routes first get the user's
`user_cache_secret` spliced into the JSON text. Responses are opened frame by frame, so
streams stay streams. The gateway's key is checked before it is used: against pinned
fingerprints, or else trusted on first use and recorded (like ssh's known_hosts), which
is logged as a warning. A 422 key-config answer (the gateway rotated its key) refetches
the key, checks it the same way and resends once. Bodyless requests pass in plaintext,
as the protocol says.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Final, cast

import httpx

from saltgate.client.secret import default_state_dir, read_or_create, resolve_user_cache_secret
from saltgate.derivations.derive import SECRET_FIELD
from saltgate.ehbp.frames import (
    ENCAPSULATED_KEY_HEADER,
    KEY_CONFIG_PROBLEM_TYPE,
    KEYS_MEDIA_TYPE,
    KEYS_PATH,
    PROBLEM_MEDIA_TYPE,
    RESPONSE_NONCE_BYTES,
    RESPONSE_NONCE_HEADER,
    EhbpError,
    KeyConfig,
    ResponseOpener,
    SealedRequest,
    parse_hex_field,
    seal_request,
)

log = logging.getLogger("saltgate.client")

# Paths (suffixes, so a base URL prefix does not matter) whose bodies get the secret.
SECRET_ROUTES: Final = ("/chat/completions", "/completions", "/responses", "/messages")
_FINGERPRINT = re.compile(r"sha256:[0-9a-f]{64}")
_FRAMING_HEADERS: Final = ("content-length", "transfer-encoding")


class GatewayKeyError(RuntimeError):
    """The gateway's key could not be fetched or is not trusted; the message says why."""


# -- pure pieces --------------------------------------------------------------------------


def splice_secret(body: bytes, secret: str) -> bytes:
    """Insert `"user_cache_secret": secret` as the first member of a JSON object body.

    Every other byte stays as the caller wrote it (no re-serialisation, so big integers,
    number spellings and key order survive). A body that is not a JSON object, or already
    has the field at top level, is returned unchanged: the caller's own value (even "",
    which means the tenant-wide cache) wins.
    """
    try:
        doc = json.loads(body)
    except ValueError:
        return body
    if not isinstance(doc, dict) or SECRET_FIELD in doc:
        return body
    start = len(body) - len(body.lstrip(b" \t\r\n"))
    if body[start : start + 1] != b"{":
        return body
    rest = body[start + 1 :]
    member = json.dumps(SECRET_FIELD).encode() + b":" + json.dumps(secret).encode()
    separator = b"" if rest.lstrip(b" \t\r\n").startswith(b"}") else b","
    return body[: start + 1] + member + separator + rest


def gateway_origin(url: str | httpx.URL) -> httpx.URL:
    """scheme://host:port of a gateway URL (the key config lives at its root)."""
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"not an http(s) URL: {url}")
    return httpx.URL(scheme=parsed.scheme, host=parsed.host, port=parsed.port)


def is_key_config_problem(status: int, headers: httpx.Headers, body: bytes) -> bool:
    if status != 422:
        return False
    if headers.get("content-type", "").split(";")[0].strip() != PROBLEM_MEDIA_TYPE:
        return False
    try:
        problem = json.loads(body)
    except ValueError:
        return False
    return isinstance(problem, dict) and problem.get("type") == KEY_CONFIG_PROBLEM_TYPE


class GatewayTrust:
    """Decides whether a gateway key may be used: pinned fingerprints if any were given,
    else trust on first use, recorded per gateway origin in the private state directory."""

    def __init__(
        self, origin: str, pins: Iterable[str] = (), state_dir: Path | None = None
    ) -> None:
        self.origin = origin
        self.pins = frozenset(pins)
        for pin in self.pins:
            if not _FINGERPRINT.fullmatch(pin):
                raise ValueError(f"a pin is 'sha256:' and 64 lower-case hex digits, got {pin!r}")
        self.state_dir = state_dir or default_state_dir()

    @property
    def mode(self) -> str:
        return "pinned" if self.pins else "trust-on-first-use"

    @property
    def record(self) -> Path:
        digest = hashlib.sha256(self.origin.encode()).hexdigest()[:32]
        return self.state_dir / f"gateway-{digest}.fingerprint"

    def check(self, config: KeyConfig) -> None:
        offered = config.fingerprint
        if self.pins:
            if offered not in self.pins:
                raise GatewayKeyError(
                    f"gateway {self.origin} offers key {offered}, which is not pinned; if the "
                    "operator rotated it, verify the new fingerprint and pin it"
                )
            return
        recorded, created = read_or_create(self.state_dir, self.record.name, lambda: offered)
        if created:
            log.warning(
                "saltgate: trusting gateway %s key %s on first use (recorded in %s); "
                "pin it to verify it instead",
                self.origin,
                offered,
                self.record,
            )
        elif recorded != offered:
            raise GatewayKeyError(
                f"gateway {self.origin} now offers key {offered}, but {recorded} was trusted "
                f"on first use ({self.record}); if the operator rotated the key, verify the "
                f"new fingerprint, then pin it or delete that file"
            )


class _Session:
    """What both transports share: the secret, the trust decision, the current key."""

    def __init__(
        self,
        gateway_url: str,
        user_cache_secret: str | None,
        pin: str | Iterable[str] | None,
        state_dir: Path | None,
    ) -> None:
        self.origin = gateway_origin(gateway_url)
        pins = [pin] if isinstance(pin, str) else list(pin or ())
        self.trust = GatewayTrust(str(self.origin).rstrip("/"), pins, state_dir)
        self.secret = resolve_user_cache_secret(user_cache_secret, state_dir=state_dir)
        self.config: KeyConfig | None = None

    def key_request(self) -> httpx.Request:
        return httpx.Request("GET", self.origin.join(KEYS_PATH))

    def accept_key(self, status: int, headers: httpx.Headers, body: bytes) -> KeyConfig:
        where = f"{self.trust.origin}{KEYS_PATH}"
        media = headers.get("content-type", "")
        if status != 200 or media != KEYS_MEDIA_TYPE:
            raise GatewayKeyError(
                f"{where} answered {status} ({media or 'no content type'}); is EHBP enabled "
                "on the gateway?"
            )
        try:
            config = KeyConfig.decode(body)
        except EhbpError as exc:
            raise GatewayKeyError(f"{where}: {exc}") from None
        self.trust.check(config)
        self.config = config
        return config

    def plaintext(self, request: httpx.Request, body: bytes) -> bytes:
        """The body to seal: the secret spliced in on the generation routes."""
        if gateway_origin(request.url) != self.origin:
            raise GatewayKeyError(
                f"this transport seals to {self.trust.origin}, not {gateway_origin(request.url)}"
            )
        if body and request.method == "POST" and request.url.path.endswith(SECRET_ROUTES):
            return splice_secret(body, self.secret)
        return body

    @staticmethod
    def sealed_request(request: httpx.Request, sealed: SealedRequest) -> httpx.Request:
        headers = httpx.Headers(request.headers)
        for name in _FRAMING_HEADERS:
            headers.pop(name, None)
        headers[ENCAPSULATED_KEY_HEADER] = sealed.enc.hex()
        return httpx.Request(
            request.method,
            request.url,
            headers=headers,
            content=sealed.body,
            extensions=request.extensions,
        )

    @staticmethod
    def response_nonce(response: httpx.Response) -> bytes | None:
        """The nonce of a sealed answer; None for a plaintext error from an intermediary."""
        values = response.headers.get_list(RESPONSE_NONCE_HEADER)
        if not values:
            if response.is_success:
                raise EhbpError(
                    f"a {response.status_code} answer without {RESPONSE_NONCE_HEADER}: "
                    "refusing an unauthenticated body"
                )
            return None
        if len(values) > 1:
            raise EhbpError(f"several {RESPONSE_NONCE_HEADER} headers")
        return parse_hex_field(values[0], RESPONSE_NONCE_BYTES, RESPONSE_NONCE_HEADER)

    @staticmethod
    def opened(
        response: httpx.Response, stream: httpx.SyncByteStream | httpx.AsyncByteStream
    ) -> httpx.Response:
        headers = httpx.Headers(response.headers)
        headers.pop("content-length", None)
        return httpx.Response(
            response.status_code, headers=headers, stream=stream, extensions=response.extensions
        )

    @staticmethod
    def key_rotated(response: httpx.Response) -> bool:
        """A buffered 422 key-config problem: the gateway holds another key now."""
        return _maybe_key_problem(response) and is_key_config_problem(
            response.status_code, response.headers, response.content
        )

    @staticmethod
    def buffered(response: httpx.Response, body: bytes) -> httpx.Response:
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            content=body,
            extensions=response.extensions,
        )


# -- the transports -----------------------------------------------------------------------


def _maybe_key_problem(response: httpx.Response) -> bool:
    """A plaintext 422: small, so it is read whole to see whether the key rotated."""
    return response.status_code == 422 and RESPONSE_NONCE_HEADER not in response.headers


class _Opened(httpx.SyncByteStream):
    """The opened body, frame by frame (read from the raw stream: a response built with
    its content, as test doubles make them, counts as already consumed for iter_raw)."""

    def __init__(self, response: httpx.Response, opener: ResponseOpener) -> None:
        self._response = response
        self._opener = opener

    def __iter__(self) -> Iterator[bytes]:
        try:
            for chunk in cast(httpx.SyncByteStream, self._response.stream):
                yield from self._opener.push(chunk)
            self._opener.finish()
        finally:
            self._response.close()

    def close(self) -> None:
        self._response.close()


class _AsyncOpened(httpx.AsyncByteStream):
    def __init__(self, response: httpx.Response, opener: ResponseOpener) -> None:
        self._response = response
        self._opener = opener

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in cast(httpx.AsyncByteStream, self._response.stream):
                for part in self._opener.push(chunk):
                    yield part
            self._opener.finish()
        finally:
            await self._response.aclose()

    async def aclose(self) -> None:
        await self._response.aclose()


class SaltgateTransport(httpx.BaseTransport):
    """Client-keyed mode for a synchronous httpx client (e.g. openai.OpenAI).

    `pin`: the gateway key fingerprint(s) to accept ("sha256:..."); several allow a planned
    rotation. Without a pin the first key seen is trusted and recorded under `state_dir`
    (default ~/.saltgate, which also holds the secret file).
    """

    def __init__(
        self,
        gateway_url: str,
        *,
        user_cache_secret: str | None = None,
        pin: str | Iterable[str] | None = None,
        state_dir: Path | None = None,
        inner: httpx.BaseTransport | None = None,
    ) -> None:
        self.session = _Session(gateway_url, user_cache_secret, pin, state_dir)
        self._inner = inner or httpx.HTTPTransport()

    def gateway_key(self, *, refresh: bool = False) -> KeyConfig:
        s = self.session
        if s.config is not None and not refresh:
            return s.config
        response = self._inner.handle_request(s.key_request())
        try:
            body = response.read()
        finally:
            response.close()
        return s.accept_key(response.status_code, response.headers, body)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        s = self.session
        body = s.plaintext(request, request.read())
        if not body:
            return self._inner.handle_request(request)
        response, sealed = self._send(request, body, self.gateway_key())
        if s.key_rotated(response):
            response, sealed = self._send(request, body, self.gateway_key(refresh=True))
        try:
            nonce = s.response_nonce(response)
        except EhbpError:
            response.close()
            raise
        if nonce is None:
            return response
        return s.opened(response, _Opened(response, sealed.response_opener(nonce)))

    def _send(
        self, request: httpx.Request, body: bytes, config: KeyConfig
    ) -> tuple[httpx.Response, SealedRequest]:
        sealed = seal_request(config, body)
        response = self._inner.handle_request(self.session.sealed_request(request, sealed))
        if _maybe_key_problem(response):
            response = self.session.buffered(response, response.read())  # read() closes
        return response, sealed

    def close(self) -> None:
        self._inner.close()


class AsyncSaltgateTransport(httpx.AsyncBaseTransport):
    """Client-keyed mode for an async httpx client (e.g. openai.AsyncOpenAI); see
    SaltgateTransport for the parameters."""

    def __init__(
        self,
        gateway_url: str,
        *,
        user_cache_secret: str | None = None,
        pin: str | Iterable[str] | None = None,
        state_dir: Path | None = None,
        inner: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.session = _Session(gateway_url, user_cache_secret, pin, state_dir)
        self._inner = inner or httpx.AsyncHTTPTransport()

    async def gateway_key(self, *, refresh: bool = False) -> KeyConfig:
        s = self.session
        if s.config is not None and not refresh:
            return s.config
        response = await self._inner.handle_async_request(s.key_request())
        try:
            body = await response.aread()
        finally:
            await response.aclose()
        return s.accept_key(response.status_code, response.headers, body)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        s = self.session
        body = s.plaintext(request, await request.aread())
        if not body:
            return await self._inner.handle_async_request(request)
        response, sealed = await self._send(request, body, await self.gateway_key())
        if s.key_rotated(response):
            response, sealed = await self._send(request, body, await self.gateway_key(refresh=True))
        try:
            nonce = s.response_nonce(response)
        except EhbpError:
            await response.aclose()
            raise
        if nonce is None:
            return response
        return s.opened(response, _AsyncOpened(response, sealed.response_opener(nonce)))

    async def _send(
        self, request: httpx.Request, body: bytes, config: KeyConfig
    ) -> tuple[httpx.Response, SealedRequest]:
        sealed = seal_request(config, body)
        response = await self._inner.handle_async_request(
            self.session.sealed_request(request, sealed)
        )
        if _maybe_key_problem(response):
            response = self.session.buffered(response, await response.aread())
        return response, sealed

    async def aclose(self) -> None:
        await self._inner.aclose()
