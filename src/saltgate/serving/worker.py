"""One worker process of `saltgate serve --workers N` (serving/supervisor.py starts it).

A fresh interpreter, not a fork: it inherits three or four file descriptors (the shared
listening socket, its end of the control channel, the connection board and, without
[cluster], its end of the channel to the supervisor's count of the host's limits:
gateway/host_limits.py) and nothing else, so no thread, lock, event loop or database
connection of the parent can be copied into it half-way. It opens its own store (its own
SQLite connections, or its own PostgreSQL listening connection, ledger pool and spool
segment), probes the replicas itself, and serves until the parent tells it to stop.

Signals: SIGTERM drains (requests in flight finish, within the HTTP server's grace),
like a single `saltgate serve`; SIGINT and SIGHUP are ignored, because a terminal sends
them to the whole process group and the parent decides (it drains every worker, or has
each reopen its access log and reload). When the parent's end of the channel closes (the
parent died), the worker drains and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from saltgate.config import ConfigError, GatewayConfig
from saltgate.ehbp.frames import Keyring, ServerKey
from saltgate.gateway.server import Gateway
from saltgate.runtime import install_uvloop
from saltgate.serving import control, event_log
from saltgate.serving.balance import ConnectionBoard
from saltgate.serving.run import SharedListener, start_gateway
from saltgate.store.errors import StoreError


class Serving(Protocol):
    """What a worker runs, as its orders reach it: the gateway's HTTP server
    (serving/run.py RunningGateway) or the EPP's ext_proc server (epp/server.py)."""

    @property
    def gateway(self) -> Gateway: ...

    def reload(self, config: GatewayConfig) -> list[asyncio.Task[Any]]: ...

    async def close(self) -> None: ...


# How a worker starts serving, from its parent's `Start`, its channel to the host's
# limits (without [cluster]) and the EHBP keyring its parent gave every worker.
Starter = Callable[[control.Start, socket.socket | None, Keyring | None], Awaitable[Serving]]


async def _serve_orders(
    running: Serving, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """Answer the parent's orders until it closes the channel."""
    while (order := await control.read_order(reader)) is not None:
        if isinstance(order, control.SendMetrics):
            snapshot = running.gateway.metrics.snapshot()
            writer.write(control.frame(control.METRICS + snapshot.to_json()))
        elif isinstance(order, control.Reload):
            config = dataclasses.replace(
                running.gateway.config,
                replicas=order.replicas,
                tls_cert_file=order.tls_cert_file,
                tls_key_file=order.tls_key_file,
            )
            probes = running.reload(config)
            await asyncio.gather(*probes, return_exceptions=True)  # serving before "done"
            writer.write(control.frame(control.RELOADED))
        elif isinstance(order, control.ReopenLog):
            reopened = running.gateway.reopen_log()
            writer.write(control.frame(control.LOG_REOPENED + (b"1" if reopened else b"0")))
        await writer.drain()


async def work(
    index: int, control_fd: int, starter: Starter, *, limits_fd: int | None = None
) -> int:
    """Start as the parent orders, say READY (or why not), serve until SIGTERM or until
    the parent is gone, then drain."""
    reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=control_fd))
    start = await control.read_order(reader)
    if not isinstance(start, control.Start):
        return 1  # the parent went away before giving an order
    event_log.configure(start.config.log_format, worker=index)
    keys = [ServerKey(raw) for raw in start.ehbp_private_keys]
    try:
        running = await starter(
            start,
            None if limits_fd is None else socket.socket(fileno=limits_fd),
            Keyring(keys[0], tuple(keys[1:])) if keys else None,
        )
    except (ConfigError, StoreError, OSError) as exc:
        tag = control.FAILED if isinstance(exc, OSError) else control.USAGE_FAILED
        writer.write(control.frame(tag + str(exc).encode()))
        await writer.drain()
        return 1 if isinstance(exc, OSError) else 2
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    writer.write(control.frame(control.READY))
    await writer.drain()
    orders = asyncio.create_task(_serve_orders(running, reader, writer))
    orders.add_done_callback(lambda _: stop.set())
    await stop.wait()
    await running.close()
    orders.cancel()
    writer.close()
    return 0


def worker_arguments(
    argv: Sequence[str] | None, prog: str, description: str | None, *fds: str
) -> argparse.Namespace:
    """A worker's command line (the parent's: supervisor.py `_spawn`), with the options
    of its kind's file descriptors `fds`; SIGINT and SIGHUP ignored from here on (the
    parent decides: the module's docstring)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for name in ("--index", "--workers", "--control-fd", *fds):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--limits-fd", type=int)
    args = parser.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    install_uvloop()
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = worker_arguments(argv, "saltgate-worker", __doc__, "--listen-fd", "--board-fd")
    board = ConnectionBoard(args.board_fd, args.workers)

    def starter(
        start: control.Start, host_limits: socket.socket | None, keyring: Keyring | None
    ) -> Awaitable[Serving]:
        listener = SharedListener(socket.socket(fileno=args.listen_fd), board.gate(args.index))
        return start_gateway(
            start.config,
            listener=listener,
            ehbp_keyring=keyring,
            workers=args.workers,
            host_limits=host_limits,
        )

    try:
        return asyncio.run(work(args.index, args.control_fd, starter, limits_fd=args.limits_fd))
    finally:
        board.close()


if __name__ == "__main__":
    sys.exit(main())
