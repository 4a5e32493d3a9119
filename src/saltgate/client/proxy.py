"""`saltgate proxy`: a loopback OpenAI-compatible endpoint that adds client-keyed caching.

Point any OpenAI-compatible tool (a coding agent, a notebook) at http://127.0.0.1:PORT/v1
with any API key: the proxy replaces it with the tenant's key, splices in the user's
`user_cache_secret` and seals the body with EHBP (AsyncSaltgateTransport), then relays the
opened answer, streams chunk by chunk. It listens on loopback only: anyone who can reach
that port can spend the key, as with any local credential helper.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import httpx

from saltgate.client.secret import SecretStoreError
from saltgate.client.transport import AsyncSaltgateTransport, GatewayKeyError
from saltgate.ehbp.frames import EhbpError
from saltgate.http import HttpServer, Request, Response
from saltgate.policy.errors import ApiError
from saltgate.runtime import until_stopped

DEFAULT_PORT: Final = 8788
LOOPBACK: Final = "127.0.0.1"
# Headers a local tool may send on: what shapes the body or its reading, nothing that
# identifies the machine (the gateway drops what it does not allow anyway).
_REQUEST_HEADERS: Final = frozenset(
    {b"content-type", b"accept", b"user-agent", b"openai-beta", b"anthropic-version"}
)
_RESPONSE_HEADERS: Final = frozenset({"content-type", "cache-control", "retry-after"})
_TIMEOUT: Final = httpx.Timeout(600.0, connect=10.0)


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    upstream: str
    api_key: str = field(repr=False)
    port: int = DEFAULT_PORT
    user_cache_secret: str | None = field(default=None, repr=False)
    pin: tuple[str, ...] = ()
    state_dir: Path | None = None


def _error(status: int, message: str) -> Response:
    error = ApiError(status, message)
    return Response(status, [(b"content-type", b"application/json")], error.body())


class Proxy:
    def __init__(self, config: ProxyConfig) -> None:
        self.upstream = httpx.URL(config.upstream.rstrip("/"))
        self.transport = AsyncSaltgateTransport(
            config.upstream,
            user_cache_secret=config.user_cache_secret,
            pin=config.pin,
            state_dir=config.state_dir,
        )
        self.client = httpx.AsyncClient(transport=self.transport, timeout=_TIMEOUT)
        self._authorization = f"Bearer {config.api_key}".encode()
        self.http = HttpServer(self.handle, error_response=_error)

    async def handle(self, request: Request) -> Response:
        headers = [(n, v) for n, v in request.headers if n in _REQUEST_HEADERS]
        headers.append((b"authorization", self._authorization))
        path = request.path.decode("utf-8", "replace")
        url = self.upstream.copy_with(
            raw_path=(self.upstream.raw_path.rstrip(b"/") + request.path)
            + (b"?" + request.query if request.query else b"")
        )
        outgoing = self.client.build_request(
            request.method.decode("ascii", "replace"), url, headers=headers, content=request.body
        )
        try:
            upstream = await self.client.send(outgoing, stream=True)
        except (GatewayKeyError, SecretStoreError, EhbpError) as exc:
            return _error(502, f"saltgate proxy: {exc}")
        except httpx.HTTPError as exc:
            return _error(502, f"saltgate proxy: cannot reach the gateway for {path}: {exc}")
        kept = [
            (name.encode(), value.encode())
            for name, value in upstream.headers.items()
            if name in _RESPONSE_HEADERS
        ]
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return Response(upstream.status_code, kept, stream=_relay(upstream))
        try:  # a whole document: open all of it before answering, so a bad frame is a 502
            body = await upstream.aread()
        except (httpx.HTTPError, EhbpError) as exc:
            return _error(502, f"saltgate proxy: the answer from the gateway broke: {exc}")
        return Response(upstream.status_code, kept, body)

    async def aclose(self) -> None:
        await self.http.close()
        await self.client.aclose()


async def _relay(upstream: httpx.Response) -> AsyncGenerator[bytes, None]:
    """An event stream as it arrives. A failure mid-stream (network, or a frame that does
    not authenticate) ends it with an error event, as the gateway does."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except (httpx.HTTPError, EhbpError) as exc:
        error = ApiError(502, f"saltgate proxy: the stream from the gateway broke: {exc}")
        yield b"data: " + error.body() + b"\n\n"
    finally:
        await upstream.aclose()


@dataclass
class RunningProxy:
    proxy: Proxy
    port: int

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    async def close(self) -> None:
        await self.proxy.aclose()


async def start_proxy(config: ProxyConfig) -> RunningProxy:
    """Check the gateway's key now (so trust is decided, and said, at start), then listen."""
    proxy = Proxy(config)
    try:
        await proxy.transport.gateway_key()
        port = await proxy.http.start(LOOPBACK, config.port)
    except BaseException:
        await proxy.client.aclose()
        raise
    return RunningProxy(proxy, port)


async def _serve(config: ProxyConfig) -> None:
    running = await start_proxy(config)
    transport = running.proxy.transport
    key = await transport.gateway_key()
    print(
        f"saltgate proxy: {running.url}/v1 -> {config.upstream} (EHBP key {key.fingerprint}, "
        f"{transport.session.trust.mode})",
        flush=True,
    )
    await until_stopped()
    await running.close()


def serve_proxy(config: ProxyConfig) -> int:
    try:
        asyncio.run(_serve(config))
    except (GatewayKeyError, SecretStoreError, ValueError) as exc:
        print(f"saltgate proxy: {exc}", file=sys.stderr)
        return 2
    except (httpx.HTTPError, OSError) as exc:
        print(f"saltgate proxy: {exc}", file=sys.stderr)
        return 1
    return 0
