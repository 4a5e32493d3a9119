"""`saltgate epp --config FILE`: start the EPP, reload [[replicas]] on SIGHUP, stop on
SIGINT or SIGTERM (docs/epp.md)."""

from __future__ import annotations

import asyncio
import logging
import signal

from saltgate.config import ConfigError, GatewayConfig
from saltgate.epp.server import start_epp
from saltgate.runtime import run_service, until_stopped
from saltgate.serving import event_log
from saltgate.serving.admin_listener import admin_scheme
from saltgate.serving.run import reread_config
from saltgate.store.errors import StoreError

log = logging.getLogger(__name__)


async def _serve(config: GatewayConfig) -> None:
    event_log.configure(config.log_format)
    running = await start_epp(config)
    replicas = len(config.replicas)
    print(
        f"saltgate: EPP (ext_proc) on {config.host}:{running.port} ({replicas} replicas)",
        flush=True,
    )
    if running.metrics is not None:
        where = f"{admin_scheme(config)}://{config.admin_host}:{running.metrics.port}"
        print(f"saltgate: metrics on {where}/metrics (an admin token with usage:read)")
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
    return run_service(
        lambda: _serve(config),
        "saltgate epp",
        cannot_run=f"cannot serve the EPP on {config.host}:{config.epp.grpc_port}",
        usage_errors=(ConfigError, StoreError),
    )
