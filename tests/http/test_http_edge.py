"""The HTTP edge over real loopback sockets: server and pooled client against each other."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncGenerator

import pytest
from tests.support.waiting import eventually

from saltgate.http import HttpServer, Request, Response, UpstreamError, UpstreamPool


async def _echo(request: Request) -> Response:
    if request.path == b"/stream":

        async def chunks() -> AsyncGenerator[bytes, None]:
            for i in range(3):
                await asyncio.sleep(0)
                yield b"part%d;" % i

        return Response(200, [(b"content-type", b"text/plain")], stream=chunks())
    body = b"%s %s %s" % (request.method, request.path, request.body)
    return Response(200, [(b"x-seen-query", request.query)], body)


async def _raw_exchange(port: int, data: bytes, read_until_close: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    out = await asyncio.wait_for(reader.read(), 5) if read_until_close else b""
    writer.close()
    return out


def test_keep_alive_reuses_one_connection() -> None:
    async def main() -> None:
        server = HttpServer(_echo)
        port = await server.start("127.0.0.1", 0)
        pool = UpstreamPool("127.0.0.1", port)
        for i in range(5):
            resp = await pool.request(b"POST", b"/x?q=1", [], b"body%d" % i)
            assert resp.status == 200
            assert resp.header(b"x-seen-query") == b"q=1"
            assert await resp.read() == b"POST /x body%d" % i
        assert pool.open_connections == 1
        await pool.close()
        await server.close()

    asyncio.run(main())


def test_streamed_response_arrives_in_chunks() -> None:
    async def main() -> None:
        server = HttpServer(_echo)
        port = await server.start("127.0.0.1", 0)
        pool = UpstreamPool("127.0.0.1", port)
        resp = await pool.request(b"GET", b"/stream", [])
        assert resp.header(b"transfer-encoding") == b"chunked"
        assert await resp.read() == b"part0;part1;part2;"
        # the connection survives a chunked response
        resp = await pool.request(b"GET", b"/again", [])
        assert await resp.read() == b"GET /again "
        assert pool.open_connections == 1
        await pool.close()
        await server.close()

    asyncio.run(main())


def test_pipelined_requests_answer_in_order() -> None:
    async def main() -> None:
        server = HttpServer(_echo)
        port = await server.start("127.0.0.1", 0)
        data = (
            b"".join(b"GET /%d HTTP/1.1\r\nhost: x\r\n\r\n" % i for i in range(3))
            + b"GET /last HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        )
        out = await _raw_exchange(port, data)
        positions = [out.index(b"GET /%s " % p) for p in (b"0", b"1", b"2", b"last")]
        assert positions == sorted(positions)
        await server.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 999999\r\n\r\n", b"413"),
        (
            b"POST /x HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n800\r\n"
            + b"a" * 2048,
            b"413",
        ),
        (b"NOT HTTP AT ALL\r\n\r\n", b"400"),
        (b"GET /x HTTP/1.1\r\nhost: x\r\n" + b"x-big: " + b"a" * 70000 + b"\r\n\r\n", b"431"),
    ],
)
def test_bad_requests_get_a_status_and_the_server_keeps_serving(
    request_bytes: bytes, status: bytes
) -> None:
    async def main() -> None:
        server = HttpServer(_echo, max_body_bytes=1024)
        port = await server.start("127.0.0.1", 0)
        out = await _raw_exchange(port, request_bytes)
        assert out.startswith(b"HTTP/1.1 " + status), out[:80]
        pool = UpstreamPool("127.0.0.1", port)
        resp = await pool.request(b"GET", b"/ok", [])
        assert await resp.read() == b"GET /ok "
        await pool.close()
        await server.close()

    asyncio.run(main())


def test_expect_continue_is_answered() -> None:
    async def main() -> None:
        server = HttpServer(_echo)
        port = await server.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /e HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 2\r\n"
            b"connection: close\r\n\r\n"
        )
        first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert first.startswith(b"HTTP/1.1 100 Continue")
        writer.write(b"hi")
        rest = await asyncio.wait_for(reader.read(), 5)
        assert rest.endswith(b"POST /e hi")
        writer.close()
        await server.close()

    asyncio.run(main())


def test_client_going_away_cancels_the_handler() -> None:
    cancelled = asyncio.Event()

    async def slow(request: Request) -> Response:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return Response(200)

    async def main() -> None:
        server = HttpServer(slow)
        port = await server.start("127.0.0.1", 0)
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        await writer.drain()
        await eventually(lambda: any(c.task is not None for c in server.connections))
        writer.close()
        await asyncio.wait_for(cancelled.wait(), 5)
        await server.close()

    asyncio.run(main())


def test_without_cancelling_a_fin_still_drops_a_cut_request_and_a_close_shows() -> None:
    """A server that lets handlers finish answers a client that half-closed (see
    test_http_faults.py), but a request the FIN cut short never reaches the handler, and
    a client that closed both sides is seen gone at the next write: an endless stream to
    it is closed, not written forever."""
    seen: list[bytes] = []
    closed: list[bool] = []

    async def endless(request: Request) -> Response:
        seen.append(request.path)
        if request.path != b"/endless":
            return Response(200, body=request.path)

        async def chunks() -> AsyncGenerator[bytes, None]:
            try:
                while True:
                    await asyncio.sleep(0.001)
                    yield b"more;"
            finally:
                closed.append(request.client.gone)

        return Response(200, stream=chunks())

    async def main() -> None:
        server = HttpServer(endless, cancel_on_disconnect=False)
        port = await server.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"GET /first HTTP/1.1\r\nhost: x\r\n\r\n"
            b"POST /cut HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nonly5"
        )
        writer.write_eof()
        out = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert out.startswith(b"HTTP/1.1 200 OK\r\n") and out.endswith(b"\r\n\r\n/first"), out
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /endless HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.wait_for(reader.readuntil(b"more;"), 5)
        writer.close()
        await eventually(lambda: closed == [True], what="the stream closed, its client gone")
        assert seen == [b"/first", b"/endless"]
        await server.close()

    asyncio.run(main())


# A stream the client cuts mid-way, closed by a close that suspends, then one more request.
_CUT_STREAM = """
import asyncio
from saltgate.http import HttpServer, Response

class Endless:
    closed = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0.005)
        return b"x"

    async def aclose(self):
        await asyncio.sleep(0.01)
        Endless.closed = True

async def handle(request):
    return Response(200, stream=Endless()) if request.path == b"/stream" else Response(204)

async def main():
    server = HttpServer(handle, cancel_on_disconnect=True)
    port = await server.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /stream HTTP/1.1\\r\\nhost: x\\r\\n\\r\\n")
    await reader.readuntil(b"x")
    writer.close()
    while not Endless.closed:
        await asyncio.sleep(0.01)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\\r\\nhost: x\\r\\nconnection: close\\r\\n\\r\\n")
    print((await reader.read()).split(b"\\r\\n")[0].decode())
    await server.close()

asyncio.run(main())
"""


def test_a_stream_cut_by_the_client_is_closed_and_the_server_goes_on() -> None:
    """The client-abort path that crashed the compiled build: a compiled server awaiting
    the close inside its except block loses the exception it re-raises (mypyc keeps no
    exception state of its own, and the cancellation's way in resets the thread's on the
    way out), and the interpreter dies. Nothing crosses tasks then, so ExceptionWatch
    cannot see it; in a child process, the crash fails this test."""
    done = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", _CUT_STREAM],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout) == (0, "HTTP/1.1 204 No Content\n"), done.stderr[-2000:]


def test_unreachable_upstream_fails_before_response() -> None:
    async def main() -> None:
        server = HttpServer(_echo)
        port = await server.start("127.0.0.1", 0)
        await server.close()
        pool = UpstreamPool("127.0.0.1", port, connect_timeout=1)
        with pytest.raises(UpstreamError) as info:
            await pool.request(b"GET", b"/", [])
        assert info.value.before_response

    asyncio.run(main())


def test_stale_pooled_connection_is_replaced_transparently() -> None:
    async def main() -> None:
        server = HttpServer(_echo, idle_timeout=0.05)
        port = await server.start("127.0.0.1", 0)
        pool = UpstreamPool("127.0.0.1", port)
        await (await pool.request(b"GET", b"/a", [])).read()
        await eventually(lambda: not server.connections)  # the server closed the idle one
        resp = await pool.request(b"GET", b"/b", [])
        assert await resp.read() == b"GET /b "
        await pool.close()
        await server.close()

    asyncio.run(main())


async def _slow(request: Request) -> Response:
    if request.path == b"/silent":
        await asyncio.sleep(5)
        return Response(200)

    async def trickle() -> AsyncGenerator[bytes, None]:
        yield b"first;"
        await asyncio.sleep(5)
        yield b"never"

    return Response(200, stream=trickle())


def test_upstream_timeouts_fail_clearly_and_close_the_connection() -> None:
    async def main() -> None:
        server = HttpServer(_slow)
        port = await server.start("127.0.0.1", 0)
        pool = UpstreamPool("127.0.0.1", port, response_timeout=0.1, read_timeout=0.2)
        with pytest.raises(UpstreamError, match="response timed out") as info:
            await pool.request(b"GET", b"/silent", [])
        assert info.value.before_response
        resp = await pool.request(b"GET", b"/trickle", [])
        chunks = resp.chunks()
        assert await anext(chunks) == b"first;"
        with pytest.raises(UpstreamError, match="read timed out") as info:
            await anext(chunks)
        assert not info.value.before_response
        await eventually(lambda: pool.open_connections == 0)  # timed out: never reused
        await pool.close()
        await server.close()

    asyncio.run(main())


def test_idle_connections_are_closed_but_busy_ones_are_not() -> None:
    async def slowish(request: Request) -> Response:
        await asyncio.sleep(0.3)  # longer than the idle timeout
        return Response(200, body=b"done")

    async def main() -> None:
        server = HttpServer(slowish, idle_timeout=0.1)
        port = await server.start("127.0.0.1", 0)
        pool = UpstreamPool("127.0.0.1", port)
        assert await (await pool.request(b"GET", b"/", [])).read() == b"done"
        assert pool.open_connections == 1
        await eventually(lambda: pool.open_connections == 0)  # closed once idle
        await pool.close()
        await server.close()

    asyncio.run(main())


@pytest.mark.parametrize("grace", [2.0, 0.0])
def test_close_lets_responses_in_progress_finish_within_the_grace(grace: float) -> None:
    async def slowish(request: Request) -> Response:
        await asyncio.sleep(0.2)
        return Response(200, body=b"finished")

    async def main() -> None:
        server = HttpServer(slowish)
        port = await server.start("127.0.0.1", 0)
        pool = UpstreamPool("127.0.0.1", port)
        pending = asyncio.create_task(pool.request(b"GET", b"/", []))
        await eventually(lambda: any(c.task is not None for c in server.connections))
        await asyncio.wait_for(server.close(grace=grace), 5)
        if grace:
            assert await (await pending).read() == b"finished"
        else:
            with pytest.raises(UpstreamError):
                await pending
        await pool.close()

    asyncio.run(main())
