"""The edge answers pipelined requests strictly in order: a differential test against h11.

A load balancer reuses one connection to the gateway for many clients' requests, so a
response written out of order, or a body where none belongs, hands one tenant's answer to
another. Hypothesis generates byte streams of pipelined requests (keep-alive and not,
HTTP/1.1 and 1.0, Content-Length and chunked bodies with trailers, HEAD, Expect:
100-continue, streamed and delayed answers) ending in a malformed request or a close,
written in random pieces. h11 is the reference twice: its server state machine says which
requests a correct server answers (every complete request before the first one it cannot
parse, then an error and a close), and its client state machine reads the edge's output
one response per request, so a body after a HEAD response, a 100 Continue inside another
response or a response out of order all break the parse.

Where the edge is deliberately stricter than h11 (h11 leaves these to the application),
the reference applies the same rules: only HTTP/1.1 and 1.0 (`STRICTER`).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import h11
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.support.http11 import h11_client, next_answer

from saltgate.http import HttpServer, Request, Response

MAX_BODY = 4096


async def echo(request: Request) -> Response:
    """Names the request it answers; streams when the path says /s, waits when it says /d."""
    auth = b"auth" if request.header(b"authorization") is not None else b"noauth"
    digest = hashlib.sha256(request.body).hexdigest()[:12].encode()
    text = b"%s %s %d %s %s" % (request.method, request.path, len(request.body), digest, auth)
    if b"/d" in request.path:
        await asyncio.sleep(0.005)
    if b"/s" in request.path:

        async def chunks() -> AsyncGenerator[bytes, None]:
            for piece in (text[:5], text[5:]):
                await asyncio.sleep(0)
                yield piece

        return Response(200, [(b"content-type", b"text/plain")], stream=chunks())
    return Response(200, [(b"content-type", b"text/plain")], text)


@dataclass(frozen=True)
class Req:
    """One well-formed request of the generated stream."""

    method: str
    path: str
    http10: bool
    connection: str | None  # "close", "keep-alive" or none
    framing: str  # "none", "length" or "chunked"
    body: bytes
    expect: bool
    trailer_auth: bool

    @property
    def closes(self) -> bool:
        """Whether the server closes the connection after answering it (a streamed answer
        to HTTP/1.0 has no length, so the close ends it)."""
        if self.http10:
            return self.connection != "keep-alive" or "/s" in self.path
        return self.connection == "close"

    def encode(self) -> tuple[bytes, bytes]:
        """(head, body bytes): a writer pauses between them when the request expects 100."""
        lines = [f"{self.method} {self.path} HTTP/{'1.0' if self.http10 else '1.1'}", "host: x"]
        if self.connection:
            lines.append(f"connection: {self.connection}")
        if self.expect:
            lines.append("expect: 100-continue")
        if self.framing == "length":
            lines.append(f"content-length: {len(self.body)}")
        elif self.framing == "chunked":
            lines.append("transfer-encoding: chunked")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode()
        if self.framing != "chunked":
            return head, self.body
        parts = [b"%x\r\n%s\r\n" % (len(p), p) for p in (self.body[:3], self.body[3:]) if p]
        trailer = b"authorization: Bearer from-the-trailer\r\n" if self.trailer_auth else b""
        return head, b"".join(parts) + b"0\r\n" + trailer + b"\r\n"

    def expected_body(self) -> bytes | None:
        if self.method == "HEAD":
            return None
        body = self.body
        digest = hashlib.sha256(body).hexdigest()[:12]
        return f"{self.method} {self.path} {len(body)} {digest} noauth".encode()

    def h11_request(self) -> h11.Request:
        headers = [("host", "x")]
        if self.expect:
            headers.append(("expect", "100-continue"))
        if self.body or self.framing != "none":
            headers.append(("content-length", str(len(self.body))))
        return h11.Request(method=self.method, target=self.path, headers=headers)


# Malformed requests, each with the status the edge answers; h11 refuses all but those
# marked STRICTER (tests below check both claims).
MALFORMED: dict[str, tuple[bytes, int]] = {
    "garbage": (b"GARBAGE\r\n\r\n", 400),
    "no-version": (b"GET /x\r\n\r\n", 400),
    "http09": (b"GET /x HTTP/0.9\r\n\r\n", 400),
    "http2": (b"GET /x HTTP/2.0\r\nhost: x\r\n\r\n", 505),
    "bad-header": (b"GET /x HTTP/1.1\r\nhost: x\r\nbad header\r\n\r\n", 400),
    "no-host": (b"GET /x HTTP/1.1\r\n\r\n", 400),
    "bad-chunk": (b"POST /x HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", 400),
    "te-gzip": (b"POST /x HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip, chunked\r\n\r\n", 501),
    "two-lengths": (
        b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
        400,
    ),
    "length-and-chunked": (
        b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n",
        400,
    ),
    "chunked-in-http10": (
        b"POST /x HTTP/1.0\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
        400,
    ),
    "too-large": (b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 99999\r\n\r\n", 413),
    "headers-too-large": (
        b"GET /x HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n",
        431,
    ),
}
# What h11 leaves to the application, and the edge refuses: versions other than 1.1 and
# 1.0, ambiguous framing (a proxy in front may read it the other way), its size limits.
STRICTER = {
    "http09",
    "http2",
    "length-and-chunked",
    "chunked-in-http10",
    "too-large",
    "headers-too-large",
}


@st.composite
def requests(draw: st.DrawFn, index: int) -> Req:
    http10 = draw(st.booleans()) and draw(st.booleans())  # a quarter of them
    method = draw(st.sampled_from(["GET", "POST", "HEAD"]))
    framings = ["none", "length"] if http10 else ["none", "length", "chunked"]
    framing = draw(st.sampled_from(framings))
    body = draw(st.binary(min_size=1, max_size=40)) if framing != "none" else b""
    connections = [None, None, "keep-alive"] if http10 else [None, None, "close"]
    connection = draw(st.sampled_from(connections))
    return Req(
        method=method,
        path=f"/{index}{draw(st.sampled_from(['', '/s', '/d', '/s/d']))}",
        http10=http10,
        connection=connection,
        framing=framing,
        body=body,
        expect=framing != "none" and not http10 and draw(st.booleans()),
        trailer_auth=framing == "chunked" and draw(st.booleans()),
    )


@st.composite
def pipelines(draw: st.DrawFn) -> tuple[list[Req], str | None, list[int]]:
    count = draw(st.integers(1, 6))
    reqs = [draw(requests(i)) for i in range(count)]
    malformed = draw(st.none() | st.sampled_from(sorted(MALFORMED)))
    cuts = draw(st.lists(st.integers(1, 400), max_size=4))
    return reqs, malformed, cuts


def ends_open(reqs: list[Req], malformed: str | None) -> bool:
    """Whether the connection is still open after the generated stream (a last request
    with `connection: close` then ends it)."""
    return malformed is None and not any(r.closes for r in reqs)


def answered(reqs: list[Req], malformed: str | None) -> tuple[list[Req], int | None]:
    """The reference server (h11 plus STRICTER): which requests get an answer, and the
    error status that ends the connection (None: it ends with a close).

    h11 closes after every HTTP/1.0 request; the edge keeps an HTTP/1.0 connection open
    when the client asks (`connection: keep-alive`), so the reference goes on reading the
    rest with a fresh h11 state machine.
    """
    data = b"".join(b"".join(r.encode()) for r in reqs)
    if malformed is not None:
        data += MALFORMED[malformed][0]
    out: list[Req] = []
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
    conn.receive_data(data)
    while len(out) < len(reqs):
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            return out, MALFORMED[malformed][1] if malformed else 400
        if event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
            break
        if not isinstance(event, h11.EndOfMessage):
            continue
        req = reqs[len(out)]
        out.append(req)
        if req.closes:
            return out, None
        conn.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
        conn.send(h11.EndOfMessage())
        if conn.our_state is h11.MUST_CLOSE:  # HTTP/1.0 kept alive: h11 would close here
            rest = conn.trailing_data[0]
            conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
            conn.receive_data(rest)
        else:
            conn.start_next_cycle()
    if len(out) == len(reqs) and malformed is not None:
        return out, MALFORMED[malformed][1]  # h11 would refuse it too, or STRICTER does
    return out, None


async def converse(port: int, reqs: list[Req], malformed: str | None, cuts: list[int]) -> bytes:
    """Write the stream in pieces (pausing after the head of each request that expects
    100, as a client waiting for it would) and read until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    pieces: list[bytes] = []
    for r in reqs:
        head, body = r.encode()
        pieces += [head, body] if r.expect else [head + body]
    if malformed is not None:
        pieces.append(MALFORMED[malformed][0])
    data = b"".join(pieces)
    pauses = {sum(len(p) for p in pieces[: i + 1]) for i, p in enumerate(pieces) if p}
    edges = sorted({0, len(data), *(c for c in cuts if c < len(data)), *pauses})
    received = asyncio.create_task(reader.read(-1))
    try:
        for start, end in itertools.pairwise(edges):
            writer.write(data[start:end])
            await writer.drain()
            await asyncio.sleep(0.002 if end in pauses else 0)
        if ends_open(reqs, malformed):
            writer.write(b"GET /end HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    except ConnectionError:
        pass  # the server closed: what it answered is what counts
    out = await asyncio.wait_for(received, 10)
    writer.close()
    return out


def read_responses(out: bytes, reqs: list[Req], error: int | None, extra_end: bool) -> None:
    """Parse the server's bytes as h11's client would, one response per request."""
    client = h11_client(out)
    expected: list[tuple[Req | None, bytes | None]] = [(r, r.expected_body()) for r in reqs]
    if error is not None:
        expected.append((None, None))
    elif extra_end:
        empty = hashlib.sha256(b"").hexdigest()[:12].encode()
        expected.append((None, b"GET /end 0 " + empty + b" noauth"))
    for n, (req, body) in enumerate(expected):
        plain = h11.Request(method="GET", target="/", headers=[("host", "x")])
        client.send(req.h11_request() if req else plain)
        if req is not None and req.body:
            client.send(h11.Data(data=req.body))
        client.send(h11.EndOfMessage())
        status, got, informational = next_answer(client)
        if req is None and error is not None:
            assert status == error, (status, error, out)
        else:
            assert status == 200, (n, status, out)
            assert informational in ([], [100]) and (not informational or (req and req.expect))
            if body is not None:
                assert got == body, (n, got, body)
        if client.our_state is h11.MUST_CLOSE or client.their_state is h11.MUST_CLOSE:
            assert n == len(expected) - 1, f"the server closed after response {n}"
            break
        client.start_next_cycle()
    assert client.trailing_data[0] == b"", (
        f"bytes after the last response: {client.trailing_data!r}"
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelines())
def test_pipelined_responses_match_the_h11_reference(
    case: tuple[list[Req], str | None, list[int]],
) -> None:
    reqs, malformed, cuts = case

    async def main() -> None:
        server = HttpServer(echo, max_body_bytes=MAX_BODY)
        port = await server.start("127.0.0.1", 0)
        try:
            out = await converse(port, reqs, malformed, cuts)
        finally:
            await server.close(grace=1)
        ok, error = answered(reqs, malformed)
        read_responses(out, ok, error, ends_open(reqs, malformed))

    asyncio.run(main())


def test_h11_refuses_every_malformed_sample_but_the_stricter_ones() -> None:
    for name, (data, _) in MALFORMED.items():
        conn = h11.Connection(h11.SERVER)
        conn.receive_data(data)
        refused = False
        try:
            while (event := conn.next_event()) is not h11.NEED_DATA:
                if isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    break
        except h11.RemoteProtocolError:
            refused = True
        assert refused == (name not in STRICTER), name
