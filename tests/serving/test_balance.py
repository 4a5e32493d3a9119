"""Workers sharing one listening socket share its connections: least connections wins.

Two HTTP servers stand in for two workers: each accepts from its own descriptor of one
listening socket (as two processes would, each with its inherited copy), on uvloop as
`saltgate serve` runs, and they keep their counts on one real shared-memory board.
Both sit in one event loop, so the one holding fewer connections is always ready at the
moment the other defers: what these tests see is the gate's rule, not the scheduler.
The positive control shows what happens without the rule: the server the loop happens to
call first takes nearly every connection that arrives alone (docs/workers.md measured
the same across processes).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
import uvloop

from saltgate.http import HttpServer, Request, Response
from saltgate.serving.acceptor import AcceptGate, Acceptor
from saltgate.serving.balance import ConnectionBoard

T = TypeVar("T")


def run_on_uvloop(test: Callable[[], Awaitable[T]]) -> T:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(test())  # type: ignore[arg-type]


class NeverDefer:
    """The positive control: a gate that counts but never leaves a connection to another."""

    def __init__(self, gate: AcceptGate) -> None:
        self.gate = gate

    def start(self) -> None:
        self.gate.start()

    def stop(self) -> None:
        self.gate.stop()

    def defer(self) -> bool:
        return False

    def opened(self) -> None:
        self.gate.opened()

    def closed(self) -> None:
        self.gate.closed()


async def _hello(request: Request) -> Response:
    return Response(200, [], b"hello")


async def _open(port: int) -> asyncio.StreamWriter:
    """A keep-alive connection that has had one answer (so it is surely accepted)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    await writer.drain()
    head = await reader.readuntil(b"hello")
    assert head.startswith(b"HTTP/1.1 200"), head
    return writer


async def _shares(k: int, *, burst: bool, gated: bool) -> list[int]:
    """Open k keep-alive connections to two servers; the connections each one holds."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    board = ConnectionBoard.create(2)
    servers = []
    for i, sock in enumerate((listener, listener.dup())):
        gate: AcceptGate = board.gate(i)
        server = HttpServer(_hello)
        Acceptor(server, sock, gate if gated else NeverDefer(gate))
        servers.append(server)
    writers: list[asyncio.StreamWriter] = []
    try:
        if burst:
            writers = list(await asyncio.gather(*(_open(port) for _ in range(k))))
        else:
            for _ in range(k):
                writers.append(await _open(port))
        counts = [board.connections(i) for i in range(2)]
        assert counts == [len(s.connections) for s in servers]  # the board counts truly
        return sorted(c or 0 for c in counts)
    finally:
        for writer in writers:
            writer.close()
        for server in servers:
            await server.close()
        board.close()


@pytest.mark.parametrize("k", [2, 4, 8, 32])
@pytest.mark.parametrize("burst", [False, True], ids=["one-by-one", "burst"])
def test_connections_split_evenly_however_they_arrive(k: int, burst: bool) -> None:
    assert run_on_uvloop(lambda: _shares(k, burst=burst, gated=True)) == [k // 2, k // 2]


def test_positive_control_without_the_gate_one_server_takes_nearly_all() -> None:
    fewer, more = run_on_uvloop(lambda: _shares(8, burst=False, gated=False))
    assert more >= 7, (fewer, more)


def test_closed_connections_leave_the_count_and_a_drained_server_takes_none() -> None:
    async def main() -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        board = ConnectionBoard.create(2)
        first, second = HttpServer(_hello), HttpServer(_hello)
        Acceptor(first, listener, board.gate(0))
        Acceptor(second, listener.dup(), board.gate(1))
        writers = [await _open(port) for _ in range(4)]
        assert [board.connections(0), board.connections(1)] == [2, 2]
        for writer in writers:
            writer.close()
            await writer.wait_closed()
        while board.connections(0) or board.connections(1):
            await asyncio.sleep(0.01)
        await first.close()  # draining: out of the share, its descriptor closed
        assert board.connections(0) is None
        writers = [await _open(port) for _ in range(3)]
        assert board.connections(1) == 3 and len(second.connections) == 3
        for writer in writers:
            writer.close()
        await second.close()
        assert board.connections(1) is None
        board.close()
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)

    run_on_uvloop(main)


def test_board_gate_defers_only_to_a_worker_that_accepts_and_holds_fewer() -> None:
    board = ConnectionBoard.create(3)
    gates = [board.gate(i) for i in range(3)]
    gates[0].start()
    assert not gates[0].defer()  # alone: nobody to defer to
    gates[0].opened()
    gates[1].start()
    assert gates[0].defer() and not gates[1].defer()
    gates[1].opened()
    assert not gates[0].defer() and not gates[1].defer()  # a tie: both may take it
    gates[1].opened()
    assert gates[1].defer()
    board.mark_down(0)  # died: its count no longer attracts connections
    assert not gates[1].defer()
    gates[2].start()
    assert gates[1].defer()
    gates[1].stop()
    gates[1].closed()  # a close while draining does not bring the slot back
    assert board.connections(1) is None
    board.close()
