"""A lean HTTP/1.1 server on asyncio protocols and httptools (llhttp).

Both the gateway and the replica simulator sit on it. A framework would cost a large share
of the per-request budget (docs/benchmarks.md); what we need is small: keep-alive,
pipelining in order, a body size cap enforced while reading, `Expect: 100-continue`,
chunked streaming with write back-pressure, and cancelling the handler when the client
goes away (so the gateway can cancel the upstream request).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import cast

import httptools

log = logging.getLogger(__name__)

Headers = list[tuple[bytes, bytes]]

_REASONS = {
    100: b"Continue",
    200: b"OK",
    204: b"No Content",
    400: b"Bad Request",
    401: b"Unauthorized",
    403: b"Forbidden",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    409: b"Conflict",
    413: b"Content Too Large",
    415: b"Unsupported Media Type",
    422: b"Unprocessable Content",
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
}
_STATUS_LINES = {code: b"HTTP/1.1 %d %s\r\n" % (code, reason) for code, reason in _REASONS.items()}
_MAX_HEADER_BYTES = 64 * 1024


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d Status\r\n" % status


@dataclass(slots=True)
class Request:
    """One parsed request; header names are lower-cased bytes."""

    method: bytes
    path: bytes
    query: bytes
    headers: Headers
    body: bytes
    peer: str = ""

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


@dataclass(slots=True)
class Response:
    """A response: a whole body, or an async stream of chunks sent with chunked encoding."""

    status: int
    headers: Headers = field(default_factory=list)
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None


Handler = Callable[[Request], Awaitable[Response]]
ErrorFactory = Callable[[int, str], Response]


def _plain_error(status: int, message: str) -> Response:
    return Response(status, [(b"content-type", b"text/plain")], message.encode() + b"\n")


class _Connection(asyncio.Protocol):
    """One client connection: parse requests, run the handler for each, in order."""

    __slots__ = (
        "_body_parts",
        "_body_size",
        "_closing",
        "_current",
        "_headers",
        "_headers_size",
        "_idle_handle",
        "_last_active",
        "_loop",
        "_parser",
        "_peer",
        "_pending",
        "_server",
        "_transport",
        "_url",
        "_writable",
    )

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: Headers = []
        self._headers_size = 0
        self._body_parts: list[bytes] = []
        self._body_size = 0
        self._pending: deque[tuple[Request, bool]] = deque()
        self._current: asyncio.Task[None] | None = None
        self._closing = False
        self._writable = asyncio.Event()
        self._writable.set()
        self._idle_handle: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()
        self._last_active = self._loop.time()
        self._peer = ""

    # -- transport callbacks -------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        peer = transport.get_extra_info("peername")
        self._peer = str(peer[0]) if isinstance(peer, tuple) else ""
        self._server.connections.add(self)
        self._arm_idle_timer(self._last_active)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._server.connections.discard(self)
        self._cancel_idle_timer()
        if self._current is not None and not self._current.done():
            self._current.cancel()
        self._pending.clear()
        self._writable.set()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def data_received(self, data: bytes) -> None:
        self._last_active = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, "protocol upgrades are not supported")
        except httptools.HttpParserError:
            if not self._closing:
                self._reject(400, "malformed HTTP request")

    # -- parser callbacks ----------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._headers_size = 0
        self._body_parts = []
        self._body_size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._headers_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers_size += len(name) + len(value)
        if self._headers_size > _MAX_HEADER_BYTES:
            self._reject(431, "request headers too large")
            return
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        if self._closing:
            return
        limit = self._server.max_body_bytes
        for name, value in self._headers:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                self._reject(413, f"request body larger than the limit of {limit} bytes")
                return
            if name == b"expect" and value.lower() == b"100-continue" and self._transport:
                self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._closing:
            return
        self._body_size += len(body)
        if self._body_size > self._server.max_body_bytes:
            limit = self._server.max_body_bytes
            self._reject(413, f"request body larger than the limit of {limit} bytes")
            return
        self._body_parts.append(body)

    def on_message_complete(self) -> None:
        if self._closing:
            return
        url = self._url
        path, _, query = url.partition(b"?")
        parts = self._body_parts
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        request = Request(self._parser.get_method(), path, query, self._headers, body, self._peer)
        keep_alive = self._parser.should_keep_alive()
        if self._current is None:
            self._current = self._loop.create_task(self._serve(request, keep_alive))
        else:
            self._pending.append((request, keep_alive))

    # -- serving -------------------------------------------------------------------------
    async def _serve(self, request: Request, keep_alive: bool) -> None:
        try:
            while True:
                await self._respond(request, keep_alive)
                if not keep_alive or self._closing:
                    self._close()
                    return
                if not self._pending:
                    self._last_active = self._loop.time()
                    return
                request, keep_alive = self._pending.popleft()
        finally:
            self._current = None

    async def _respond(self, request: Request, keep_alive: bool) -> None:
        server = self._server
        try:
            response = await server.handler(request)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("handler failed")
            response = server.error_response(500, "internal error")
        transport = self._transport
        if transport is None or self._closing:
            return
        head = [status_line(response.status)]
        for name, value in response.headers:
            head.append(b"%s: %s\r\n" % (name, value))
        if not keep_alive:
            head.append(b"connection: close\r\n")
        if response.stream is None:
            head.append(b"content-length: %d\r\n\r\n" % len(response.body))
            head.append(response.body)
            transport.write(b"".join(head))
            return
        head.append(b"transfer-encoding: chunked\r\n\r\n")
        transport.write(b"".join(head))
        await self._write_stream(transport, response.stream)

    async def _write_stream(
        self, transport: asyncio.Transport, stream: AsyncIterator[bytes]
    ) -> None:
        try:
            async for chunk in stream:
                if self._closing:
                    return
                if chunk:
                    transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    if not self._writable.is_set():
                        await self._writable.wait()
            if not self._closing:
                transport.write(b"0\r\n\r\n")
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    # -- helpers -------------------------------------------------------------------------
    def _reject(self, status: int, message: str) -> None:
        """Answer a request we will not read to the end, then close the connection."""
        if self._closing:
            return
        self._closing = True
        transport = self._transport
        if transport is not None:
            response = self._server.error_response(status, message)
            head = [status_line(status)]
            head.extend(b"%s: %s\r\n" % (n, v) for n, v in response.headers)
            head.append(b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(response.body))
            head.append(response.body)
            transport.write(b"".join(head))
            transport.close()

    def _close(self) -> None:
        self._closing = True
        if self._transport is not None:
            self._transport.close()

    def _arm_idle_timer(self, since: float) -> None:
        """One timer per connection: activity only stamps the time, the timer re-arms."""
        timeout = self._server.idle_timeout
        if timeout > 0:
            self._idle_handle = self._loop.call_at(since + timeout, self._idle_check)

    def _cancel_idle_timer(self) -> None:
        if self._idle_handle is not None:
            self._idle_handle.cancel()
            self._idle_handle = None

    def _idle_check(self) -> None:
        self._idle_handle = None
        if self._closing:
            return
        if self._current is not None:  # busy answering: idle time starts when it ends
            self._arm_idle_timer(self._loop.time())
        elif self._loop.time() >= self._last_active + self._server.idle_timeout:
            self._close()
        else:
            self._arm_idle_timer(self._last_active)

    def shutdown(self) -> None:
        """Close now if idle; otherwise close after the response in progress."""
        if self._current is None:
            self._close()
        else:
            self._pending.clear()
            self._current.add_done_callback(lambda _: self._close())

    @property
    def busy(self) -> bool:
        return self._current is not None

    def abort(self) -> None:
        """Cancel the response in progress and close."""
        if self._current is not None:
            self._current.cancel()
        self._close()


class HttpServer:
    """Serve `handler` on a TCP socket; `error_response` shapes the server's own errors."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_body_bytes: int = 8 * 1024 * 1024,
        idle_timeout: float = 75.0,
        error_response: ErrorFactory = _plain_error,
    ) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.idle_timeout = idle_timeout
        self.error_response = error_response
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int, *, backlog: int = 1024) -> int:
        """Bind and start serving; returns the bound port (useful with port 0)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), host, port, backlog=backlog, reuse_address=True
        )
        sockets = self._server.sockets
        return int(sockets[0].getsockname()[1]) if sockets else port

    async def close(self, grace: float = 5.0) -> None:
        """Stop accepting; let responses in progress finish for up to `grace` seconds."""
        if self._server is None:
            return
        self._server.close()
        for conn in list(self.connections):
            conn.shutdown()
        deadline = asyncio.get_running_loop().time() + grace
        while any(c.busy for c in self.connections):
            if asyncio.get_running_loop().time() >= deadline:
                for conn in list(self.connections):
                    conn.abort()
                break
            await asyncio.sleep(0.01)
        await self._server.wait_closed()
        self._server = None
