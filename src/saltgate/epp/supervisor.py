"""`saltgate epp --workers N`: the parent of `saltgate serve --workers N`
(serving/supervisor.py) around N EPP workers (epp/worker.py) serving the one `[epp]
grpc_port`.

gRPC cannot serve an inherited listening socket, so each worker binds the port itself
with SO_REUSEPORT (grpcio sets it on Linux) and the kernel spreads Envoy's connections
among them. The parent holds the port with a bound socket that does not listen: the
workers join it (and a restarted one finds the port free), `grpc_port = 0` becomes one
port for all, and while no worker runs a connection is refused (Envoy then refuses the
request: fail closed). Everything else is the gateway's supervisor: the host's limits
counted once (governance/arbiter.py), /metrics on `[epp] metrics_port` merged from every
worker, SIGHUP reloading [[replicas]] in every worker, SIGTERM draining them all, a dead
worker restarted.
"""

from __future__ import annotations

import dataclasses
import socket

from saltgate.config import GatewayConfig
from saltgate.epp import GRPC_OPTIONS
from saltgate.epp.metrics import metrics_tls, serve_metrics
from saltgate.epp.run import announce, run_epp
from saltgate.runtime import listen_error
from saltgate.serving import event_log
from saltgate.serving.supervisor import Supervisor, supervise


def reserve(host: str, port: int) -> socket.socket:
    """A socket bound to host:port with SO_REUSEPORT, not listening: the port held for
    the workers, who bind it beside it (the first address `host` resolves to)."""
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


class EppSupervisor(Supervisor):
    module = "saltgate.epp.worker"

    def worker_config(self) -> GatewayConfig:
        """A worker binds the port the parent holds; the parent serves /metrics."""
        config = super().worker_config()
        epp = dataclasses.replace(config.epp, grpc_port=self.port, metrics_port=None)
        return dataclasses.replace(config, epp=epp)

    def bind(self) -> socket.socket:
        config = self.config
        try:
            return reserve(config.host, config.epp.grpc_port)
        except OSError as exc:
            raise listen_error(GRPC_OPTIONS, config.host, config.epp.grpc_port, exc) from None

    def listener_argv(self) -> list[tuple[str, int]]:
        return []  # each worker binds the port itself

    def check_front(self) -> None:
        metrics_tls(self.config)

    async def start_front(self) -> None:
        """/metrics on [epp] metrics_port: every worker's, merged."""
        config = self.config
        if config.epp.metrics_port is not None:
            tls = metrics_tls(config)
            self._admin, self.admin_port = await serve_metrics(
                config, self._admin_api, self._render, self._access_log, tls
            )


def serve_epp_workers(config: GatewayConfig, workers: int) -> int:
    """`saltgate epp --workers N`; the exit status, as `saltgate.epp.run.serve`."""
    return run_epp(config, lambda: _serve(config, workers))


async def _serve(config: GatewayConfig, workers: int) -> None:
    event_log.configure(config.log_format, supervisor=True)
    supervisor = EppSupervisor(config, workers)
    await supervisor.start()
    announce(config, supervisor.port, supervisor.admin_port, f", {workers} workers")
    await supervise(supervisor, config)
