"""One worker process of `saltgate epp --workers N` (epp/supervisor.py starts it): an
EPP (epp/server.py) binding the one `[epp] grpc_port` beside its siblings (gRPC's
SO_REUSEPORT), with the gateway worker's channels and its life (serving/worker.py: its
parent's orders, its share of the host's limits through the supervisor, SIGTERM drains,
SIGINT and SIGHUP left to the parent)."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Awaitable, Sequence

from saltgate.ehbp.frames import Keyring
from saltgate.epp.server import start_epp
from saltgate.serving import control
from saltgate.serving.worker import Serving, work, worker_arguments


def main(argv: Sequence[str] | None = None) -> int:
    args = worker_arguments(argv, "saltgate-epp-worker", __doc__)

    def starter(
        start: control.Start, host_limits: socket.socket | None, keyring: Keyring | None
    ) -> Awaitable[Serving]:
        return start_epp(
            start.config, workers=args.workers, host_limits=host_limits, keyring=keyring
        )

    return asyncio.run(work(args.index, args.control_fd, starter, limits_fd=args.limits_fd))


if __name__ == "__main__":
    sys.exit(main())
