"""A pooled HTTP/1.1 client for upstream replicas, on asyncio protocols and httptools.

The gateway forwards every request over kept-alive connections; a general-purpose client
(httpx, aiohttp) costs several times the parse-and-forward work itself. Responses are
read as a stream of body chunks so SSE passes through without buffering. A connection
goes back to the pool only after its response was read to the end; a cancelled or broken
exchange closes it, which is also how an abandoned request is cancelled upstream.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from typing import cast

import httptools

from saltgate.http.tls import tls_failure

Headers = list[tuple[bytes, bytes]]


class UpstreamError(Exception):
    """The upstream could not be reached or broke the exchange.

    `before_response` says whether anything of the response had arrived, which decides
    whether a retry on another replica is safe.
    """

    def __init__(self, message: str, *, before_response: bool) -> None:
        super().__init__(message)
        self.before_response = before_response


class _UpstreamConnection(asyncio.Protocol):
    """One kept-alive connection; one exchange at a time.

    Timeouts cost one timer per connection, not one per exchange or per await: an
    exchange only stamps its response deadline, and the watchdog, when it fires, re-arms
    itself for whatever is due next (the current exchange's deadline, or while the body
    streams the time left since the last data arrived: data_received just stamps it). A
    finished exchange leaves the timer armed; it disarms when it finds the connection idle.
    """

    __slots__ = (
        "_chunks",
        "_deadline",
        "_done",
        "_headers",
        "_headers_future",
        "_last_data",
        "_loop",
        "_parser",
        "_read_timeout",
        "_waiter",
        "_watchdog",
        "_watchdog_at",
        "broken",
        "pool",
        "status",
        "transport",
    )

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpResponseParser(self)
        self._headers: Headers = []
        self._headers_future: asyncio.Future[None] | None = None
        self._chunks: deque[bytes] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._watchdog_at = 0.0
        self._deadline: float | None = None
        self._read_timeout: float | None = None
        self._last_data = 0.0
        self._done = False
        self.broken = False
        self.status = 0

    # transport callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.broken = True
        self._stop_watchdog()
        self.pool._forget(self)
        # A TLS 1.3 server refuses a client certificate after the handshake: its alert
        # ends the first exchange, and says why.
        why = f": {tls_failure(exc)}" if isinstance(exc, ssl.SSLError) else ""
        self._fail("upstream closed the connection" + why)

    def data_received(self, data: bytes) -> None:
        self._last_data = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self.broken = True
            self._fail("malformed response from upstream")
            if self.transport is not None:
                self.transport.close()

    # parser callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        future = self._headers_future
        if future is not None and not future.done():
            future.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._wake(None)

    def on_message_complete(self) -> None:
        self._done = True
        if not self._parser.should_keep_alive():
            self.broken = True
        self._wake(None)

    # failure and wake-ups
    def _fail(self, message: str) -> None:
        """Fail whoever waits: the headers (nothing arrived yet) or the body reader."""
        future = self._headers_future
        if future is not None and not future.done():
            future.set_exception(UpstreamError(message, before_response=True))
        elif not self._done:
            self._wake(UpstreamError(message, before_response=False))

    def _wake(self, error: Exception | None) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            if error is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(error)

    def _arm(self, when: float) -> None:
        self._watchdog = self._loop.call_at(when, self._on_watchdog)
        self._watchdog_at = when

    def _on_watchdog(self) -> None:
        self._watchdog = None
        now = self._loop.time()
        future = self._headers_future
        if future is not None and not future.done():
            if self._deadline is None:
                return
            if now >= self._deadline:
                self.expire("upstream response timed out")
            else:  # armed for an earlier exchange: this one is due later
                self._arm(self._deadline)
            return
        if self._read_timeout is None or self._done:
            return  # idle, or the response ended: disarm
        idle_until = self._last_data + self._read_timeout
        if now >= idle_until:
            self.expire("upstream read timed out")
        else:
            self._arm(idle_until)

    def expire(self, message: str) -> None:
        self.broken = True
        self._fail(message)
        if self.transport is not None:
            self.transport.close()

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    # exchange
    def begin(
        self, response_timeout: float | None, read_timeout: float | None
    ) -> asyncio.Future[None]:
        self._headers = []
        self._chunks.clear()
        self._done = False
        self.status = 0
        self._read_timeout = read_timeout
        self._headers_future = self._loop.create_future()
        if response_timeout is None:
            self._deadline = None
        else:
            self._deadline = self._loop.time() + response_timeout
            if self._watchdog is not None and self._watchdog_at > self._deadline:
                self._stop_watchdog()  # armed for later than this exchange may take
            if self._watchdog is None:
                self._arm(self._deadline)
        return self._headers_future

    @property
    def headers(self) -> Headers:
        return self._headers

    def take_body(self) -> bytes:
        """The whole body, when the response already ended (no waiting needed)."""
        chunks = self._chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        return body

    async def next_chunk(self) -> bytes | None:
        """The next body chunk, or None at the end of the response."""
        while True:
            if self._chunks:
                return self._chunks.popleft()
            if self._done:
                return None
            if self.broken:
                raise UpstreamError("upstream closed the connection", before_response=False)
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    @property
    def done(self) -> bool:
        return self._done and not self._chunks


class UpstreamResponse:
    """Status, headers, and the body as chunks; `release` must be called (read() does it)."""

    __slots__ = ("_conn", "_released", "headers", "status")

    def __init__(self, conn: _UpstreamConnection) -> None:
        self._conn = conn
        self._released = False
        self.status = conn.status
        self.headers = conn.headers

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def read(self) -> bytes:
        conn = self._conn
        if conn._done:  # the usual case for small bodies: it all came with the headers
            body = conn.take_body()
            self.release()
            return body
        parts = []
        while (chunk := await self.next_chunk()) is not None:
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def next_chunk(self) -> bytes | None:
        """The next piece of the body, or None at its end (the connection is then released)."""
        try:
            chunk = await self._conn.next_chunk()
        except BaseException:
            self.release()
            raise
        if chunk is None:
            self.release()
        return chunk

    def chunks(self) -> UpstreamResponse:
        """The body as an async iterator of chunks (a class, not an async generator, which
        mypyc cannot compile); `aclose` releases the connection, as the end of it does."""
        return self

    def __aiter__(self) -> UpstreamResponse:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self.next_chunk()
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        self.release()

    def interrupt(self, message: str) -> None:
        """End the body from this side: the connection is closed (never reused) and the
        pending and every later `next_chunk`, once what arrived is read, raise
        UpstreamError(`message`)."""
        self._conn.expire(message)

    def release(self) -> None:
        """Return the connection to the pool if its response ended cleanly, else close it."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        if conn.done and not conn.broken:
            conn.pool._put_back(conn)
        else:
            conn.pool._discard(conn)


class UpstreamPool:
    """Kept-alive connections to one upstream (host, port), over TLS when ``tls`` is a
    client context (http/tls.py): the certificate is verified for ``host`` before a byte
    of a request is written; a context set later serves the connections made after.

    ``address``: connect there instead of resolving ``host`` (an IP address the caller
    resolved and checked: gateway/media.py), ``host`` staying the TLS name; ``authority``:
    the Host header (default ``host:port``)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        tls: ssl.SSLContext | None = None,
        max_idle: int = 256,
        connect_timeout: float = 5.0,
        response_timeout: float | None = 600.0,
        read_timeout: float | None = 600.0,
        address: str | None = None,
        authority: str | None = None,
    ) -> None:
        self.host = host
        self.address = host if address is None else address
        self.port = port
        self.tls = tls
        self.max_idle = max_idle
        self.connect_timeout = connect_timeout
        self.response_timeout = response_timeout
        self.read_timeout = read_timeout
        self._idle: list[_UpstreamConnection] = []
        self._all: set[_UpstreamConnection] = set()
        self._host_header = (f"{host}:{port}" if authority is None else authority).encode()

    @property
    def open_connections(self) -> int:
        return len(self._all)

    async def _connect(self) -> _UpstreamConnection:
        loop = asyncio.get_running_loop()
        tls = self.tls
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _UpstreamConnection(self),
                    self.address,
                    self.port,
                    ssl=tls,
                    server_hostname=self.host if tls is not None else None,
                ),
                self.connect_timeout,
            )
        except ssl.SSLError as refused:  # one name per exception type (mypyc: buildinfo.py)
            raise UpstreamError(
                f"TLS handshake with upstream failed: {tls_failure(refused)}",
                before_response=True,
            ) from None
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(
                f"cannot connect to upstream: {exc.__class__.__name__}", before_response=True
            ) from None
        self._all.add(conn)
        return conn

    def _take_idle(self) -> _UpstreamConnection | None:
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.broken and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def request(
        self, method: bytes, path: bytes, headers: Headers, body: bytes = b""
    ) -> UpstreamResponse:
        """Send one request; returns once the response headers have arrived.

        A kept-alive connection the upstream closed meanwhile fails before any response;
        that case is retried once on a fresh connection, so callers only see real failures.
        """
        head = [b"%s %s HTTP/1.1\r\nhost: %s\r\n" % (method, path, self._host_header)]
        for name, value in headers:
            head.append(b"%s: %s\r\n" % (name, value))
        head.append(b"content-length: %d\r\n\r\n" % len(body))
        head.append(body)
        payload = b"".join(head)
        conn = self._take_idle()
        reused = conn is not None
        for _attempt in range(2):
            if conn is None:
                conn = await self._connect()
            try:
                return await self._exchange(conn, payload)
            except UpstreamError as exc:
                self._discard(conn)
                if not (reused and exc.before_response):
                    raise
                conn, reused = None, False
        raise AssertionError("unreachable")

    async def _exchange(self, conn: _UpstreamConnection, payload: bytes) -> UpstreamResponse:
        headers_ready = conn.begin(self.response_timeout, self.read_timeout)
        transport = conn.transport
        assert transport is not None
        transport.write(payload)
        try:
            await headers_ready
        except asyncio.CancelledError:
            self._discard(conn)
            raise
        return UpstreamResponse(conn)

    def _put_back(self, conn: _UpstreamConnection) -> None:
        if len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            self._discard(conn)

    def _discard(self, conn: _UpstreamConnection) -> None:
        conn.broken = True
        conn._stop_watchdog()
        self._forget(conn)
        if conn.transport is not None:
            conn.transport.close()

    def _forget(self, conn: _UpstreamConnection) -> None:
        self._all.discard(conn)

    async def close(self) -> None:
        for conn in list(self._all):
            self._discard(conn)
        self._idle.clear()
        await asyncio.sleep(0)
