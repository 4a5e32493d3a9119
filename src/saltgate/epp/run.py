"""`saltgate epp --config FILE`: start the EPP, reload [[replicas]] on SIGHUP, stop on
SIGINT or SIGTERM (docs/epp.md)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Coroutine
from typing import Any

from saltgate.config import ConfigError, GatewayConfig
from saltgate.epp.server import start_epp
from saltgate.runtime import run_service, until_stopped
from saltgate.serving import event_log
from saltgate.serving.admin_listener import admin_scheme
from saltgate.serving.run import reread_config
from saltgate.store.errors import StoreError

log = logging.getLogger(__name__)


def announce(config: GatewayConfig, port: int, metrics_port: int | None, workers: str = "") -> None:
    """The lines that say where the EPP serves (``workers``: ", N workers" or nothing)."""
    print(
        f"saltgate: EPP (ext_proc) on {config.host}:{port} "
        f"({len(config.replicas)} replicas{workers})",
        flush=True,
    )
    if metrics_port is not None:
        where = f"{admin_scheme(config)}://{config.admin_host}:{metrics_port}"
        print(f"saltgate: metrics on {where}/metrics (an admin token with usage:read)")


def run_epp(config: GatewayConfig, main: Callable[[], Coroutine[Any, Any, None]]) -> int:
    """Run ``main`` as `saltgate epp`, one process or the workers' parent; the exit
    status (saltgate.runtime.run_service)."""
    return run_service(
        main,
        "saltgate epp",
        cannot_run=f"cannot serve the EPP on {config.host}:{config.epp.grpc_port}",
        usage_errors=(ConfigError, StoreError),
    )


async def _serve(config: GatewayConfig) -> None:
    event_log.configure(config.log_format)
    running = await start_epp(config)
    announce(config, running.port, running.metrics.port if running.metrics else None)
    path = config.config_file
    if path is not None:

        def reload() -> None:
            fresh = reread_config(path)
            if fresh is not None:
                running.gateway.reload(fresh)
                log.info("reloaded %s: %d replicas", path, len(fresh.replicas))

        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)
    await until_stopped()
    log.info("stopping: requests in flight finish")
    await running.close()


def serve(config: GatewayConfig) -> int:
    return run_epp(config, lambda: _serve(config))
