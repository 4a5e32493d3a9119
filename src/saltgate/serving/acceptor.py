"""Accepting from a listening socket that the workers of `serve --workers N` share.

Why not the event loop's own server: it accepts every queued connection at once, so
whichever process wakes first takes a whole burst, and a load balancer's few keep-alive
connections can all land in one process (docs/workers.md measures it). The `Acceptor`
takes one connection per readiness event and asks the `AcceptGate` (balance.py) whether
a process holding fewer connections should have it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from typing import Final, Protocol, cast

from saltgate.http import HttpServer

log = logging.getLogger(__name__)

# How long a process that holds more connections than another leaves a new connection to
# it before taking it anyway (the other is busy), and how long to stop accepting after
# accept() itself failed (no file descriptors left, say).
_DEFER_S: Final = 0.002
_ACCEPT_RETRY_S: Final = 0.1
# A TLS client that does not finish its handshake within this is dropped (a drain waits
# for the handshakes under way).
_HANDSHAKE_S: Final = 10.0


class AcceptGate(Protocol):
    """Shares the connections of one listening socket among the processes accepting from
    it (serving/balance.py): each connection is counted from accept to close, between
    `start` (this process accepts) and `stop` (it no longer does)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def defer(self) -> bool:
        """True if another process holds fewer connections and should take the next one."""
        ...

    def opened(self) -> None: ...

    def closed(self) -> None: ...


class Acceptor:
    """Accepts from a listening socket other processes accept from too, one connection
    per readiness event, and leaves a connection for `_DEFER_S` to a process that holds
    fewer (the gate's call) before taking it itself."""

    def __init__(
        self,
        server: HttpServer,
        sock: socket.socket,
        gate: AcceptGate,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """Start accepting for ``server``, which serves what this hands it (over TLS with
        ``tls``: the TLS handshake before it) and closes it."""
        self._server = server
        self._tls = tls
        self._sock = sock
        self._gate = gate
        self._loop = asyncio.get_running_loop()
        self._fd = sock.fileno()
        self._timer: asyncio.TimerHandle | None = None
        self._setups: set[asyncio.Task[None]] = set()
        gate.start()
        server.on_connection_lost = gate.closed
        server.serve_from(self)
        sock.setblocking(False)
        self._loop.add_reader(self._fd, self._ready)

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    def _ready(self) -> None:
        if self._gate.defer():
            self._pause(_DEFER_S, then_accept=True)
        else:
            self._accept()

    def _accept(self) -> None:
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):  # another process took it
            return
        except OSError as exc:
            log.warning("accept failed, pausing: %s", exc)
            self._pause(_ACCEPT_RETRY_S, then_accept=False)
            return
        self._gate.opened()
        task = self._loop.create_task(self._attach(conn))
        self._setups.add(task)
        task.add_done_callback(self._setups.discard)

    def _pause(self, delay: float, *, then_accept: bool) -> None:
        self._loop.remove_reader(self._fd)
        self._timer = self._loop.call_later(delay, self._resume, then_accept)

    def _resume(self, then_accept: bool) -> None:
        """Listen again; after a deferral, take the connection if it is still queued
        (nobody with fewer connections took it in time)."""
        self._timer = None
        self._loop.add_reader(self._fd, self._ready)
        if then_accept:
            self._accept()

    async def _attach(self, conn: socket.socket) -> None:
        protocol = self._server.connection()
        try:
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await self._loop.connect_accepted_socket(
                lambda: cast(asyncio.Protocol, protocol),
                conn,
                ssl=self._tls,
                ssl_handshake_timeout=_HANDSHAKE_S if self._tls is not None else None,
            )
        # The client left at once or failed the TLS handshake (an ssl.SSLError, plain HTTP
        # included); the loop is closing.
        except (OSError, RuntimeError) as exc:
            log.debug("accepted connection not served: %s", exc)
            if not protocol.made:  # connection_lost will not count its close
                self._gate.closed()
                conn.close()

    def close(self) -> None:
        """Stop accepting and close this process's copy of the listening socket."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._loop.remove_reader(self._fd)
        self._sock.close()
        self._gate.stop()

    async def wait_closed(self) -> None:
        """Until the connections accepted so far are handed to the server (or dropped)."""
        await asyncio.gather(*self._setups, return_exceptions=True)
