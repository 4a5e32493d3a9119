"""One test per fault the adversarial run found in the edge (each failed on the old code).

Responses are read with h11's client state machine, so a response cut, merged into
another or carrying a body it must not have fails the parse, not just an assertion.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest
from tests.support.http11 import responses

from saltgate.http import Handler, HttpServer, Request, Response


class Recorder:
    """A handler that remembers what it finished, streams on /s and is slow on /slow."""

    def __init__(self) -> None:
        self.finished: list[bytes] = []

    async def __call__(self, request: Request) -> Response:
        auth = request.header(b"authorization") or b"-"
        text = b"%s %s %s" % (request.method, request.path, auth)
        if request.method == b"HEAD":
            return Response(405, [(b"allow", b"POST")], b"method not allowed: " + text)
        if request.path.startswith(b"/slow"):
            await asyncio.sleep(0.05)
        if request.path.startswith(b"/s"):

            async def chunks() -> AsyncGenerator[bytes, None]:
                for i in range(4):
                    await asyncio.sleep(0.01)
                    yield b"%s part %d;" % (text, i)
                self.finished.append(request.path)

            return Response(200, stream=chunks())
        self.finished.append(request.path)
        return Response(200, body=text)


async def serve(handler: Handler, **kw: int) -> tuple[HttpServer, int]:
    server = HttpServer(handler, **kw)  # type: ignore[arg-type]
    return server, await server.start("127.0.0.1", 0)


async def exchange(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    out = await asyncio.wait_for(reader.read(-1), 10)
    writer.close()
    return out


def test_a_malformed_request_is_answered_after_the_response_before_it() -> None:
    async def main() -> None:
        handler = Recorder()
        server, port = await serve(handler)
        for first in (b"/slow", b"/s"):  # a whole answer, and a streamed one
            out = await exchange(
                port,
                b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhiGARBAGE\r\n\r\n"
                % first,
            )
            (ok, body, _), (refused, _, _) = responses(out, ["POST", "GET"])
            assert ok == 200 and body.startswith(b"POST " + first), out
            assert refused == 400
            assert handler.finished[-1] == first  # it ran to its end, not cancelled
        await server.close()

    asyncio.run(main())


def test_continue_goes_only_to_the_request_being_read_after_the_one_ahead() -> None:
    async def main() -> None:
        server, port = await serve(Recorder())
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"GET /s HTTP/1.1\r\nhost: x\r\n\r\n"
            b"POST /e HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 2\r\n"
            b"connection: close\r\n\r\n"
        )
        head = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5)  # the stream's end
        assert b"100 Continue" not in head, head
        writer.write(b"ok")
        out = head + await asyncio.wait_for(reader.read(-1), 5)
        writer.close()
        (streamed, body, early), (last, echoed, informational) = responses(out, ["GET", "POST"])
        assert (streamed, early) == (200, [])
        assert body.count(b"part") == 4
        assert (last, echoed, informational) == (200, b"POST /e -", [100])
        await server.close()

    asyncio.run(main())


def test_a_response_to_head_has_no_body_whatever_its_status() -> None:
    async def main() -> None:
        server, port = await serve(Recorder())
        out = await exchange(
            port,
            b"HEAD /health HTTP/1.1\r\nhost: x\r\n\r\n"
            b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        )
        (head_status, head_body, _), (get_status, get_body, _) = responses(out, ["HEAD", "GET"])
        assert (head_status, head_body) == (405, b"")
        assert (get_status, get_body) == (200, b"GET /health -")
        await server.close()

    asyncio.run(main())


def test_trailer_fields_never_become_request_headers() -> None:
    async def main() -> None:
        server, port = await serve(Recorder())
        out = await exchange(
            port,
            b"POST /t HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\nconnection: close\r\n"
            b"\r\n2\r\nhi\r\n0\r\nauthorization: Bearer sk-from-trailer\r\n\r\n",
        )
        [(status, body, _)] = responses(out, ["POST"])
        assert (status, body) == (200, b"POST /t -")
        await server.close()

    asyncio.run(main())


async def upload_then_read(port: int, head: bytes, body_bytes: int) -> bytes:
    """Send a head, keep sending body bytes as a client unaware of the refusal would,
    then read the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    block = b"x" * 65536
    try:
        for _ in range(body_bytes // len(block)):
            writer.write(block)
            await writer.drain()
    except ConnectionError:
        pass
    try:
        out = await asyncio.wait_for(reader.read(-1), 10)
    except ConnectionError as exc:
        out = b"reset: %r" % exc
    writer.close()
    return out


def test_refusals_of_oversized_requests_arrive_whole() -> None:
    async def main() -> None:
        server, port = await serve(Recorder(), max_body_bytes=1024)
        for _ in range(5):
            out = await upload_then_read(
                port, b"POST /big HTTP/1.1\r\nhost: x\r\ncontent-length: 4194304\r\n\r\n", 4194304
            )
            assert [s for s, _, _ in responses(out, ["POST"])] == [413], out[:200]
            for end in (b"\r\n\r\n", b""):  # a huge header line, ended and never ended
                out = await upload_then_read(
                    port, b"GET /big HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 70_000 + end, 1048576
                )
                assert [s for s, _, _ in responses(out, ["GET"])] == [431], out[:200]
        await server.close()

    asyncio.run(main())


def test_requests_without_http_1_x_are_refused_and_never_served() -> None:
    async def main() -> None:
        handler = Recorder()
        server, port = await serve(handler)
        for data, status in (
            (b"GET /nover\r\n\r\n", 400),
            (b"GET /nine HTTP/0.9\r\n\r\n", 400),
            (b"GET /two HTTP/2.0\r\nhost: x\r\n\r\n", 505),
        ):
            out = await exchange(port, data)
            assert out.startswith(b"HTTP/1.1 %d " % status), out
        assert handler.finished == []
        await server.close()

    asyncio.run(main())


def test_an_upgrade_request_is_answered_and_the_connection_closed() -> None:
    async def main() -> None:
        handler = Recorder()
        server, port = await serve(handler)
        out = await exchange(
            port,
            b"GET /up HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n"
            b"\x81\x85not http at all",
        )
        [(status, body, _)] = responses(out, ["GET"])
        assert (status, body) == (200, b"GET /up -")
        await server.close()

    asyncio.run(main())


class Paced:
    """Answers after `wait_s`: in whole, or on /s in `parts` chunks `gap_s` apart; records
    whether the client was gone when an answer was complete."""

    def __init__(self, wait_s: float, gap_s: float, parts: int = 5) -> None:
        self.wait_s, self.gap_s, self.parts = wait_s, gap_s, parts
        self.gone: list[bool] = []

    def expected(self, path: bytes, body: bytes) -> bytes:
        if path == b"/s":
            return b"".join(b"part %d;" % k for k in range(self.parts))
        return b"whole " + body

    async def __call__(self, request: Request) -> Response:
        await asyncio.sleep(self.wait_s)
        if request.path != b"/s":
            self.gone.append(request.client.gone)
            return Response(200, body=self.expected(request.path, request.body))

        async def chunks() -> AsyncGenerator[bytes, None]:
            for k in range(self.parts):
                await asyncio.sleep(self.gap_s)
                yield b"part %d;" % k
            self.gone.append(request.client.gone)

        return Response(200, stream=chunks())


async def half_close(port: int, data: bytes, fin: str) -> bytes:
    """Send ``data``, shut down the sending side ("with" the requests, "later" while the
    answer is prepared, or "reading" once its first byte came back), and read to EOF."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    first = b""
    if fin == "later":
        await asyncio.sleep(0.001)
    elif fin == "reading":
        first = await asyncio.wait_for(reader.read(1), 5)
    writer.write_eof()
    out = first + await asyncio.wait_for(reader.read(-1), 5)
    writer.close()
    return out


@pytest.mark.parametrize("fin", ["with", "later", "reading"])
@pytest.mark.parametrize("length", [b"  %d ", b"%d"], ids=["padded-length", "length"])
def test_a_client_that_half_closes_after_its_requests_gets_every_answer(
    fin: str, length: bytes
) -> None:
    """RFC 9112, section 9.6: a connection half-closed by the client "does not delimit a
    request message, nor does it imply that the client is no longer interested in a
    response". A server that lets its handlers finish when a client leaves (the
    gateway's) answers every request it read before the FIN, in full, then closes; the
    old code took the FIN for the client leaving, and dropped or cut the answer. Streamed
    and whole answers, alone and pipelined, with the handler's pace varied against the FIN."""

    async def main() -> None:
        for wait_s, gap_s in ((0.0, 0.0), (0.002, 0.0), (0.0, 0.001), (0.003, 0.002)):
            handler = Paced(wait_s, gap_s)
            server, port = await serve(handler, cancel_on_disconnect=False)
            for i in range(8):
                body = b"%d" % i
                for paths in ([b"/s"], [b"/w"], [b"/s", b"/w"], [b"/w", b"/s"]):
                    data = b"".join(
                        b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length:%s\r\n\r\n%s"
                        % (path, length % len(body), body)
                        for path in paths
                    )
                    out = await half_close(port, data, fin)
                    got = [(status, b) for status, b, _ in responses(out, ["POST"] * len(paths))]
                    want = [(200, handler.expected(path, body)) for path in paths]
                    assert got == want, (wait_s, gap_s, paths, out[-300:])
            await server.close()
            assert len(handler.gone) == 8 * 6 and not any(handler.gone)

    asyncio.run(main())


def test_whitespace_around_a_header_value_is_not_part_of_it() -> None:
    """llhttp keeps the whitespace after a value: `Content-Length:  99999 ` over the
    limit got 100 Continue instead of 413 (the client then sent the body for nothing),
    `Expect: 100-continue ` no 100 at all, and handlers saw `v ` for `v`."""

    async def echo(request: Request) -> Response:
        return Response(200, body=b"[%s]" % request.header(b"x-v"))

    async def main() -> None:
        server, port = await serve(echo, max_body_bytes=1024)
        for length, expect, status in ((b"  99999 ", b"", 413), (b" 2\t", b" \t", 100)):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST / HTTP/1.1\r\nhost: x\r\nx-v:  v \t\r\nexpect: 100-continue%s\r\n"
                b"content-length:%s\r\nconnection: close\r\n\r\n" % (expect, length)
            )
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 %d " % status), head
            if status == 100:
                writer.write(b"ok")
                out = await asyncio.wait_for(reader.read(-1), 5)
                assert out.startswith(b"HTTP/1.1 200 ") and out.endswith(b"[v]"), out
            writer.close()
        await server.close()

    asyncio.run(main())
