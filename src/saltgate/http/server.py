"""A lean HTTP/1.1 server on asyncio protocols and httptools (llhttp).

Both the gateway and the replica simulator sit on it. A framework would cost a large share
of the per-request budget (docs/benchmarks.md); what we need is small: keep-alive,
pipelining, a body size cap enforced while reading, `Expect: 100-continue`, chunked
streaming with write back-pressure, and knowing when the client went away.

One rule keeps a connection safe when a load balancer reuses it for many clients' requests:
**responses leave in the order the requests arrived, one complete response per request.**
So a request the server refuses (malformed, too large, an HTTP version it does not speak)
is answered only after every earlier response is complete, and then the connection closes
gracefully; `100 Continue` goes only to the request being read once nothing is ahead of it;
a response to HEAD carries no body; chunked trailers never become headers. The test suite
checks this against h11's state machine (tests/http/test_http_pipeline.py).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import socket
import ssl
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol, cast

import httptools

log = logging.getLogger(__name__)

Headers = list[tuple[bytes, bytes]]

_REASONS = {
    100: b"Continue",
    200: b"OK",
    204: b"No Content",
    304: b"Not Modified",
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
    499: b"Client Closed Request",
    500: b"Internal Server Error",
    501: b"Not Implemented",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
    505: b"HTTP Version Not Supported",
}
_STATUS_LINES = {code: b"HTTP/1.1 %d %s\r\n" % (code, reason) for code, reason in _REASONS.items()}
_MAX_HEADER_BYTES: Final = 64 * 1024
# A keep-alive connection idle this long is closed: nginx's default, and longer than the
# 60 s idle timeout of common load balancers, so one in front closes an idle connection
# first instead of reusing one this server is closing (docs/config.md, "Fixed limits").
IDLE_TIMEOUT_S: Final = 75.0
# Requests read ahead of the one being answered; beyond this the server stops reading.
_MAX_QUEUED: Final = 32
# After its last response, a closing connection half-closes and reads (and drops) what the
# client still sends for this long, so that data in flight does not turn the close into a
# reset that destroys the response before the client reads it.
_LINGER_S: Final = 2.0
# Closing: after the grace, the time answers cut short have to write their last event.
CUT_GRACE_S: Final = 2.0
_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
_HEAD: Final = b"HEAD"
_VERSIONS: Final = ("1.1", "1.0")


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d Status\r\n" % status


_BODILESS: Final = frozenset({204, 304})
# The connection header a response carries: (keep the connection open, HTTP/1.0 client).
_CONNECTION: Final = {
    (False, False): b"connection: close\r\n",
    (False, True): b"connection: close\r\n",
    (True, False): b"",
    (True, True): b"connection: keep-alive\r\n",
}


@dataclass(slots=True, eq=False)
class Client:
    """The connection a request came on, as its handler may see it: ``gone`` turns True
    when the client closed it or it broke, e.g. to record that an answer was not delivered."""

    peer: str = ""
    gone: bool = False
    # Called once when the client closes its side or the connection breaks: a request
    # still waiting for a replica (gateway/fairshare.py) takes either as leaving; nothing
    # has been asked of a replica yet, and a half-closed client still reads the 499.
    on_gone: Callable[[], None] | None = None


@dataclass(slots=True)
class Request:
    """One parsed request; header names are lower-cased bytes."""

    method: bytes
    path: bytes
    query: bytes
    headers: Headers
    body: bytes
    client: Client = field(default_factory=Client)

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


class BodyStream(Protocol):
    """A streamed response body. The server always calls `aclose`, whether it sent the
    whole body, part of it, or none (the client left first): the stream owns what its
    body depends on (an upstream exchange, say) and must let go of it there."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    def __anext__(self) -> Awaitable[bytes]: ...

    def aclose(self) -> Awaitable[object]: ...


@dataclass(slots=True)
class Response:
    """A response: a whole body, or a stream of chunks sent with chunked encoding."""

    status: int
    headers: Headers = field(default_factory=list)
    body: bytes = b""
    stream: BodyStream | None = None


class _Listening(Protocol):
    """A server's sockets, as any sequence: uvloop's are a list where asyncio's stubs say
    tuple, and the compiled build checks what it reads against the declared type."""

    @property
    def sockets(self) -> Sequence[socket.socket]: ...


Handler = Callable[[Request], Awaitable[Response]]
ErrorFactory = Callable[[int, str], Response]


def _plain_error(status: int, message: str) -> Response:
    return Response(status, [(b"content-type", b"text/plain")], message.encode() + b"\n")


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing: the refusal is already queued."""


@dataclass(slots=True)
class _Refusal:
    """The answer to a request the server will not read: sent after every earlier
    response, then the connection closes."""

    status: int
    message: str
    head_only: bool = False


# A request waiting for its answer: (request, keep the connection open after it, HTTP/1.0).
_Queued = tuple[Request, bool, bool]


class _Phase(enum.IntEnum):
    """Where a connection is in its life; ordered: the phases that read come first.

    AWAITING_REQUEST: reading, between requests (none begun since the last one's end).
    READING_HEAD: reading a request's line and headers; their size limit applies.
    READING_BODY: the head is read; reading its body, if it has one.
    CONTINUE_OWED: the head is read and the client waits for `100 Continue` before
        sending the body; it goes once every earlier response is complete (`_serve`).
    ANSWERING: reading stopped (a refusal, an upgrade, shutdown): answering what was
        read, then closing.
    HALF_CLOSED: the client sent FIN: answering every request read before it, then
        closing at once (nothing more can arrive, so no linger).
    CLOSING: the last response is sent (lingering, or closed), or the connection is
        closed or lost: nothing more is read or written.
    """

    AWAITING_REQUEST = 0
    READING_HEAD = 1
    READING_BODY = 2
    CONTINUE_OWED = 3
    ANSWERING = 4
    HALF_CLOSED = 5
    CLOSING = 6


class _Connection(asyncio.Protocol):
    """One client connection: parse requests as they arrive; one task answers them in order."""

    __slots__ = (
        "_body_parts",
        "_body_size",
        "_client",
        "_head_fields",
        "_head_from",
        "_headers",
        "_headers_size",
        "_idle_handle",
        "_last_active",
        "_linger_handle",
        "_loop",
        "_parser",
        "_phase",
        "_queue",
        "_read_paused",
        "_received",
        "_server",
        "_task",
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
        self._head_fields = 0  # fields in the head; any after it are trailers
        self._received = 0  # bytes read on this connection
        self._head_from = 0  # _received when the request being read began
        self._body_parts: list[bytes] = []
        self._body_size = 0
        self._queue: deque[_Queued | _Refusal] = deque()
        self._task: asyncio.Task[None] | None = None
        self._phase = _Phase.AWAITING_REQUEST
        # Apart from the phase: reading pauses while the read-ahead queue is full, whatever
        # is being parsed (more of a buffer already read goes on being parsed meanwhile).
        self._read_paused = False
        self._writable = asyncio.Event()
        self._writable.set()
        self._idle_handle: asyncio.TimerHandle | None = None
        self._linger_handle: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()
        self._last_active = self._loop.time()
        self._client = Client()

    # -- transport callbacks -------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        peer = transport.get_extra_info("peername")
        self._client.peer = str(peer[0]) if isinstance(peer, tuple) else ""
        self._server.connections.add(self)
        self._arm_idle_timer(self._last_active)

    def connection_lost(self, exc: Exception | None) -> None:
        self._phase = _Phase.CLOSING
        self._client.gone = True
        self._left()
        self._server.connections.discard(self)
        closed = self._server.on_connection_lost
        if closed is not None:
            closed()
        self._cancel_idle_timer()
        if self._linger_handle is not None:
            self._linger_handle.cancel()
            self._linger_handle = None
        self._queue.clear()  # requests not yet started never reached the handler
        self._writable.set()
        task = self._task
        if task is not None and not task.done():
            if self._server.cancel_on_disconnect:
                task.cancel()
            else:  # it goes on without a connection; close() must still wait for it
                orphans = self._server.orphans
                orphans.add(task)
                task.add_done_callback(orphans.discard)

    def _left(self) -> None:
        gone = self._client.on_gone
        if gone is not None:
            self._client.on_gone = None
            gone()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def data_received(self, data: bytes) -> None:
        self._last_active = self._loop.time()
        if self._phase >= _Phase.ANSWERING:
            return  # refused, upgraded or closing: what follows is dropped unread
        self._received += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._upgrade_requested()
        except httptools.HttpParserError:
            if self._phase < _Phase.ANSWERING:  # not a refusal raised from a callback
                self._refuse(400, "malformed HTTP request")
            return
        # llhttp reports a header only once its line ends, and buffers it until then: a
        # line that never ends is refused here (counting from the read the head began in).
        if (
            self._phase is _Phase.READING_HEAD
            and self._received - self._head_from > _MAX_HEADER_BYTES
        ):
            self._refuse(431, "request headers too large")

    def eof_received(self) -> bool:
        """The client closed its sending side: a half-close, or a close (TCP does not tell).

        A server that cancels handlers when the client leaves takes it, as nginx and vLLM's
        server do, for the client leaving: the transport closes and `connection_lost`
        follows. Otherwise (the gateway's handlers run to their end anyway) it only ends
        the requests: RFC 9112, section 9.6, a half-close "does not delimit a request
        message, nor does it imply that the client is no longer interested in a response".
        Every request read before it is answered, then the connection closes; one cut
        short by it is dropped. A client that closed both sides shows when a write fails.
        """
        self._left()
        if self._server.cancel_on_disconnect or self._task is None:
            return False
        if self._phase is not _Phase.CLOSING:
            self._phase = _Phase.HALF_CLOSED
        return True

    # -- parser callbacks ----------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._head_from = self._received
        self._url = b""
        self._headers = []
        self._headers_size = 0
        self._phase = _Phase.READING_HEAD
        self._body_parts = []
        self._body_size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._headers_size += len(url)
        if self._headers_size > _MAX_HEADER_BYTES:
            self._refuse(431, "request headers too large", stop=True)

    def on_header(self, name: bytes, value: bytes) -> None:
        """llhttp drops the whitespace before a value but keeps what trails it, which is
        not part of the value (RFC 9112, section 5): `Content-Length:  216 ` is 216."""
        self._headers_size += len(name) + len(value)
        if self._headers_size > _MAX_HEADER_BYTES:
            self._refuse(431, "request headers too large", stop=True)
        self._headers.append((name.lower(), value.rstrip(b" \t")))

    def on_headers_complete(self) -> None:
        self._phase = _Phase.READING_BODY
        self._head_fields = len(self._headers)
        parser = self._parser
        version = parser.get_http_version()
        if version not in _VERSIONS:
            if version == "0.9":  # a request line without a version, or HTTP/0.9
                self._refuse(400, "malformed HTTP request: HTTP/1.1 or 1.0 required", stop=True)
            self._refuse(505, "only HTTP/1.1 and HTTP/1.0 are supported", stop=True)
        found = _read_head(self._headers, version, self._server.max_body_bytes)
        if found is None:
            return
        status, message = found  # by value: the compiled build re-creates the tuple
        if status == _CONTINUE_STATUS:
            if self._task is None and not self._queue and self._transport is not None:
                self._transport.write(_CONTINUE)
            else:  # another response is ahead: the 100 waits for it (see _serve)
                self._phase = _Phase.CONTINUE_OWED
        else:
            self._refuse(status, message, head_only=parser.get_method() == _HEAD, stop=True)

    def on_body(self, body: bytes) -> None:
        self._phase = _Phase.READING_BODY  # if a 100 was owed, the client is sending anyway
        self._body_size += len(body)
        if self._body_size > self._server.max_body_bytes:
            self._refuse(413, _too_large(self._server.max_body_bytes), stop=True)
        self._body_parts.append(body)

    def on_message_complete(self) -> None:
        self._phase = _Phase.AWAITING_REQUEST
        url = self._url
        path, _, query = url.partition(b"?")
        parts = self._body_parts
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        headers = self._headers
        if len(headers) > self._head_fields:  # chunked trailers: never read as headers
            del headers[self._head_fields :]
        parser = self._parser
        request = Request(parser.get_method(), path, query, headers, body, self._client)
        self._enqueue((request, parser.should_keep_alive(), parser.get_http_version() == "1.0"))
        if (
            len(self._queue) >= _MAX_QUEUED
            and self._transport is not None
            and not self._read_paused
        ):
            self._read_paused = True
            self._transport.pause_reading()

    # -- the queue -----------------------------------------------------------------------
    def _enqueue(self, item: _Queued | _Refusal) -> None:
        self._queue.append(item)
        if self._task is None:
            self._task = self._loop.create_task(self._serve())

    def _refuse(
        self, status: int, message: str, *, head_only: bool = False, stop: bool = False
    ) -> None:
        """Answer the request being read with an error, after every earlier response, and
        read no further; ``stop`` (inside a parser callback) ends the parse at once."""
        if self._phase < _Phase.ANSWERING:
            self._phase = _Phase.ANSWERING
            self._enqueue(_Refusal(status, message, head_only))
        if stop:
            raise _Refused

    def _upgrade_requested(self) -> None:
        """Upgrade and CONNECT are not served: the request is answered as any other, and
        the connection then closes, since what follows it is not HTTP/1.1."""
        self._stop_reading()
        last = self._queue[-1] if self._queue else None
        if isinstance(last, tuple):
            self._queue[-1] = (last[0], False, last[2])
        else:
            self._enqueue(_Refusal(400, "protocol upgrades are not supported"))

    # -- serving -------------------------------------------------------------------------
    async def _serve(self) -> None:
        queue = self._queue
        try:
            while queue and self._phase is not _Phase.CLOSING:
                item = queue.popleft()
                if self._read_paused and len(queue) < _MAX_QUEUED // 2:
                    self._read_paused = False
                    if self._transport is not None:
                        self._transport.resume_reading()
                if isinstance(item, _Refusal):
                    self._write_refusal(item)
                    self._finish()
                    return
                keep_alive = await self._respond(item)
                if not keep_alive:
                    self._finish()
                    return
            if self._phase is _Phase.CONTINUE_OWED and self._transport is not None:
                self._phase = _Phase.READING_BODY
                self._transport.write(_CONTINUE)
            self._last_active = self._loop.time()
        finally:
            self._task = None

    async def _respond(self, item: _Queued) -> bool:
        """Answer one request; returns whether the connection stays open after it."""
        server = self._server
        request, keep_alive, http10 = item
        try:
            response = await server.handler(request)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("handler failed")
            response = server.error_response(500, "internal error")
        stream = response.stream
        failure: BaseException | None = None
        try:
            transport = self._transport
            if transport is None or self._phase is _Phase.CLOSING:
                keep_alive = False
            else:
                # HTTP/1.0 has no chunked coding: the close ends a streamed body.
                keep_alive = keep_alive and (stream is None or not http10) and self._may_stay_open()
                chunked = _write_head(transport, request.method, response, keep_alive, http10)
                if stream is not None and chunked is not None:
                    await self._write_stream(transport, stream, chunked=chunked)
                keep_alive = keep_alive and self._may_stay_open()
        except BaseException as exc:
            failure = exc  # the stream is closed below, outside the handler (buildinfo.py)
        if stream is not None:
            await _close_stream(stream)
        if failure is not None:
            raise failure
        return keep_alive

    def _may_stay_open(self) -> bool:
        """Not once closing, nor once the client sent FIN and the response being sent is
        the last it is owed."""
        phase = self._phase
        if phase is _Phase.HALF_CLOSED:
            return bool(self._queue)
        return phase is not _Phase.CLOSING

    async def _write_stream(
        self, transport: asyncio.Transport, stream: BodyStream, *, chunked: bool
    ) -> None:
        writable = self._writable
        async for chunk in stream:
            if self._phase is _Phase.CLOSING:
                return  # the client left: the caller closes the stream
            if chunk:
                transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                if not writable.is_set():
                    await writable.wait()
        if chunked and self._phase is not _Phase.CLOSING:
            transport.write(b"0\r\n\r\n")

    def _write_refusal(self, refusal: _Refusal) -> None:
        transport = self._transport
        if transport is None or self._phase is _Phase.CLOSING:
            return
        response = self._server.error_response(refusal.status, refusal.message)
        head = [status_line(refusal.status)]
        head.extend(b"%s: %s\r\n" % (n, v) for n, v in response.headers)
        head.append(b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(response.body))
        if not refusal.head_only:
            head.append(response.body)
        transport.write(b"".join(head))

    # -- closing -------------------------------------------------------------------------
    def _finish(self) -> None:
        """Close after the last response: half-close, then drop what the client still
        sends until it closes too or `_LINGER_S` passes (a close with unread data would
        reset the connection, and a reset can destroy the response before it is read)."""
        self._stop_reading()
        self._queue.clear()
        transport = self._transport
        phase = self._phase
        if phase is _Phase.CLOSING or transport is None:
            return
        self._phase = _Phase.CLOSING
        if phase is _Phase.HALF_CLOSED or not transport.can_write_eof():  # nothing to drop
            transport.close()
            return
        if self._read_paused:
            self._read_paused = False
            transport.resume_reading()
        transport.write_eof()
        self._linger_handle = self._loop.call_later(_LINGER_S, transport.close)

    def _stop_reading(self) -> None:
        """Read no further; what was read is still answered. From a reading phase to
        ANSWERING; a later phase (after a FIN, or closing) stays."""
        self._phase = max(self._phase, _Phase.ANSWERING)

    def _close(self) -> None:
        self._phase = _Phase.CLOSING
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
        if self._phase is _Phase.CLOSING:
            return
        if self._task is not None:  # busy answering: idle time starts when it ends
            self._arm_idle_timer(self._loop.time())
        elif self._loop.time() >= self._last_active + self._server.idle_timeout:
            self._close()
        else:
            self._arm_idle_timer(self._last_active)

    def shutdown(self) -> None:
        """Close now if idle; otherwise once the response in progress is complete."""
        self._stop_reading()
        if self._task is None:
            self._close()
        else:
            self._queue.clear()
            self._task.add_done_callback(lambda _: self._close())

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task

    @property
    def made(self) -> bool:
        """connection_made ran, so connection_lost will run too."""
        return self._transport is not None

    def abort(self) -> None:
        """Cancel the response in progress and close."""
        if self._task is not None:
            self._task.cancel()
        self._close()


def _write_head(
    transport: asyncio.Transport, method: bytes, response: Response, keep_alive: bool, http10: bool
) -> bool | None:
    """Write the status line and headers, and a whole body with them. For a stream whose
    body is to be sent, return whether it goes chunked; otherwise None."""
    status = response.status
    head = [status_line(status)]
    for name, value in response.headers:
        head.append(b"%s: %s\r\n" % (name, value))
    head.append(_CONNECTION[keep_alive, http10])
    # A HEAD response and a 204 / 304 carry no body, whatever the handler gave.
    has_body = status >= 200 and status not in _BODILESS
    send_body = has_body and method != _HEAD
    if response.stream is None:
        if has_body:
            head.append(b"content-length: %d\r\n" % len(response.body))
        head.append(b"\r\n")
        if send_body:
            head.append(response.body)
        transport.write(b"".join(head))
        return None
    chunked = send_body and not http10
    head.append(b"transfer-encoding: chunked\r\n\r\n" if chunked else b"\r\n")
    transport.write(b"".join(head))
    return chunked if send_body else None


async def _close_stream(stream: BodyStream) -> None:
    try:
        await stream.aclose()
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("closing a response stream failed")


_CONTINUE_STATUS: Final = 100
_EXPECTS_CONTINUE: Final = (_CONTINUE_STATUS, "")
_HEAD_FIELDS: Final = frozenset({b"host", b"content-length", b"transfer-encoding", b"expect"})


def _read_head(headers: Headers, version: str, limit: int) -> tuple[int, str] | None:
    """Read a request head in one pass: why it must be refused before its body is read, if
    it must (framing a proxy in front could read differently, a body over the limit, a
    missing Host), else `_EXPECTS_CONTINUE` if an HTTP/1.1 client waits for 100 Continue."""
    hosts = 0
    expects = False
    for name, value in headers:
        if name not in _HEAD_FIELDS:
            continue
        if name == b"host":
            hosts += 1
        elif name == b"content-length":
            if value.isdigit() and int(value) > limit:
                return 413, _too_large(limit)
        elif name == b"transfer-encoding":
            if version == "1.0":  # RFC 9112, section 6.1: faulty framing
                return 400, "Transfer-Encoding is not allowed in HTTP/1.0"
            if value.strip().lower() != b"chunked":
                return 501, "only the chunked transfer coding is supported"
        elif name == b"expect":
            expects = value.lower() == b"100-continue" and version == "1.1"
    if hosts > 1 or (hosts == 0 and version == "1.1"):  # RFC 9112, section 3.2
        return 400, "an HTTP/1.1 request needs exactly one Host header"
    return _EXPECTS_CONTINUE if expects else None


def _too_large(limit: int) -> str:
    return f"request body larger than the limit of {limit} bytes"


class Listener(Protocol):
    """Connections from somewhere other than the server's own socket: a socket other
    processes accept from too (serving/acceptor.py). It hands each one to
    `HttpServer.connection`."""

    def close(self) -> None:
        """Stop taking connections."""
        ...

    async def wait_closed(self) -> None:
        """Until the connections taken so far are handed over."""
        ...


class Accepted(Protocol):
    """What a `Listener` needs of the protocol it attaches a connection to."""

    @property
    def made(self) -> bool: ...


class HttpServer:
    """Serve `handler` on a TCP socket; `error_response` shapes the server's own errors.

    ``cancel_on_disconnect``: cancel a handler whose client went away (the simulator
    stops generating, like vLLM), and take the client's FIN for it going away. The gateway
    turns it off: an exchange it started with a replica runs to its end, so it is metered
    exactly (`Client.gone` tells it the client left), and a client that half-closed after
    its request still gets the answer (`_Connection.eof_received`).
    """

    def __init__(
        self,
        handler: Handler,
        *,
        max_body_bytes: int = 8 * 1024 * 1024,
        idle_timeout: float = IDLE_TIMEOUT_S,
        error_response: ErrorFactory = _plain_error,
        cancel_on_disconnect: bool = True,
    ) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.idle_timeout = idle_timeout
        self.error_response = error_response
        self.cancel_on_disconnect = cancel_on_disconnect
        self.connections: set[_Connection] = set()
        # Answering tasks that go on after their client left (the gateway's finish an
        # exchange to meter it); close() waits for them as for the connections' own.
        self.orphans: set[asyncio.Task[None]] = set()
        # Told of every connection's end (a Listener that counts connections sets it).
        self.on_connection_lost: Callable[[], None] | None = None
        self._server: asyncio.Server | None = None
        self._listener: Listener | None = None

    async def start(
        self, host: str, port: int, *, backlog: int = 1024, tls: ssl.SSLContext | None = None
    ) -> int:
        """Bind and start serving (over TLS with a server context: the gateway's edge, or
        the simulator standing in for an https replica); returns the bound port (useful
        with port 0)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), host, port, backlog=backlog, reuse_address=True, ssl=tls
        )
        listening: _Listening = self._server
        sockets = listening.sockets
        return int(sockets[0].getsockname()[1]) if sockets else port

    def serve_from(self, listener: Listener) -> None:
        """Serve the connections ``listener`` hands over, instead of a socket of its own;
        `close` closes it."""
        self._listener = listener

    async def _settle(self, timeout: float) -> None:
        """Until no response is in progress (new ones may start on the connections open
        meanwhile), for up to `timeout` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while tasks := {t for c in self.connections if (t := c.task) is not None} | self.orphans:
            left = deadline - loop.time()
            if left <= 0:
                return
            await asyncio.wait(tasks, timeout=left, return_when=asyncio.FIRST_COMPLETED)

    def connection(self) -> Accepted:
        """The protocol for one connection a `Listener` accepted."""
        return _Connection(self)

    async def close(
        self,
        grace: float = 5.0,
        *,
        cut: Callable[[], object] | None = None,
        cut_grace: float = CUT_GRACE_S,
    ) -> None:
        """Stop accepting; let responses in progress finish for up to `grace` seconds;
        then `cut` (the handler ends its answers itself, each with its last words) and
        up to `cut_grace` seconds more for them to be written; then cancel what is left
        and wait for it to unwind.

        With `cut` (the gateway's drain), the connections open go on being answered
        during the grace, so a balancer's probe on one reads that the handler is not
        ready (and new requests on them get the handler's refusal); they close as soon
        as no response is in progress, or when the grace ends. Without it, each closes
        once its response in progress is complete."""
        if self._listener is not None:
            self._listener.close()
            await self._listener.wait_closed()
        elif self._server is not None:
            self._server.close()
        else:
            return
        if cut is not None:
            await self._settle(grace)
            grace = 0.0
        for conn in list(self.connections):
            conn.shutdown()
        tasks = {t for c in self.connections if (t := c.task) is not None} | self.orphans
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=grace)
            if late and cut is not None:
                cut()
                _, late = await asyncio.wait(late, timeout=cut_grace)
            if late:
                for conn in list(self.connections):
                    conn.abort()
                for task in late:
                    task.cancel()
                await asyncio.gather(*late, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        self._server = None
        self._listener = None
