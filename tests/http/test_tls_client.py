"""The upstream pool over TLS, against a blocking OpenSSL server on a thread: what the
pool reports when the server refuses it during or right after the handshake."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
from pathlib import Path

import pytest
from tests.support.tls import make_pki

from saltgate.http import UpstreamError, UpstreamPool
from saltgate.http.tls import client_context, server_context


def _serve_once(context: ssl.SSLContext) -> tuple[int, threading.Thread, list[bytes]]:
    """Accept one connection, run the handshake and read a request; what it read."""
    listener = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []

    def serve() -> None:
        conn, _ = listener.accept()
        listener.close()
        tls = context.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        try:
            tls.do_handshake()
            received.append(tls.recv(65536))
        except (ssl.SSLError, OSError):
            # The handshake failed and the alert is sent. Close as real servers do (a
            # lingering close): stop writing, then read until the client closes. Closing
            # at once over the client's unread request makes the kernel send a reset,
            # which can overtake the alert (5 runs in 30 beside CPU hogs).
            with contextlib.suppress(OSError):
                tls.shutdown(socket.SHUT_WR)  # drops the TLS layer: plain reads below
                tls.settimeout(10)
                while tls.recv(65536):
                    pass
        finally:
            tls.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return int(listener.getsockname()[1]), thread, received


def test_a_servers_refusal_of_the_client_certificate_is_named(tmp_path: Path) -> None:
    """TLS 1.3: the client's handshake completes before the server checks its
    certificate; the server's alert then ends the first exchange, and the pool says why."""
    pki = make_pki(tmp_path)
    port, thread, received = _serve_once(
        server_context(pki.server.cert, pki.server.key, pki.client_ca)
    )

    async def body() -> None:
        pool = UpstreamPool("127.0.0.1", port, tls=client_context(pki.ca))
        with pytest.raises(UpstreamError, match="alert certificate required") as refused:
            await pool.request(b"GET", b"/health", [])
        assert refused.value.before_response  # safe to try another replica
        await pool.close()

    asyncio.run(body())
    thread.join(10)
    assert received == []  # the server read no request


def test_a_client_certificate_is_presented_and_accepted(tmp_path: Path) -> None:
    """The positive control: the same server reads the request from a pool with the
    client certificate."""
    pki = make_pki(tmp_path)
    port, thread, received = _serve_once(
        server_context(pki.server.cert, pki.server.key, pki.client_ca)
    )

    async def body() -> None:
        tls = client_context(pki.ca, pki.client.cert, pki.client.key)
        pool = UpstreamPool("127.0.0.1", port, tls=tls, response_timeout=0.5)
        with pytest.raises(UpstreamError, match=r"closed|timed out"):
            await pool.request(b"GET", b"/health", [])  # the server reads, never answers
        await pool.close()

    asyncio.run(body())
    thread.join(10)
    assert received and received[0].startswith(b"GET /health HTTP/1.1\r\n")
