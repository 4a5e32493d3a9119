"""The EPP's /metrics (`[epp] metrics_port`, docs/epp.md): the gateway's admin listener
serving /metrics alone, on `[gateway] admin_host`, with its protections: the Host check,
an admin token that may read the fleet's traffic, the admin listener's TLS files and its
refusal of plain HTTP off loopback.

The families are the gateway's (`Gateway` and its `Exchange` describe them on the
EPP's `Metrics` as on the gateway's) and the ext_proc server's own (saltgate/epp/server).
"""

from __future__ import annotations

import dataclasses
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from saltgate.admin.api import AdminApi
from saltgate.admin.store import AdminStore
from saltgate.config import GatewayConfig
from saltgate.gateway.access_log import AccessLog
from saltgate.gateway.server import Gateway
from saltgate.http import HttpServer
from saltgate.serving.admin_listener import AdminListener, admin_tls, start_admin_listener


def _as_admin(config: GatewayConfig, port: int) -> GatewayConfig:
    """The configuration the admin listener's parts read: admin_port is the metrics port."""
    return dataclasses.replace(config, admin_port=port)


def metrics_tls(config: GatewayConfig) -> ssl.SSLContext | None:
    """The metrics listener's TLS context, or the ConfigError that refuses it (plain HTTP
    off loopback without `allow_plaintext_admin`): before anything is bound."""
    port = config.epp.metrics_port
    return None if port is None else admin_tls(_as_admin(config, port))


@dataclass
class MetricsListener:
    server: HttpServer
    port: int
    api: AdminApi  # its store checks the scrapers' tokens

    async def close(self) -> None:
        await self.server.close()
        await self.api.store.aclose()


async def start_metrics_listener(
    config: GatewayConfig, gateway: Gateway, log: AccessLog, tls: ssl.SSLContext | None
) -> MetricsListener | None:
    """/metrics on admin_host:[epp] metrics_port (0: a free port); None when it is off."""
    if config.epp.metrics_port is None:
        return None
    api = AdminApi(AdminStore(config.store_settings), usage=gateway.usage, prices=config.prices)
    metrics = gateway.metrics

    async def render() -> bytes:
        return metrics.render()

    try:
        server, bound = await serve_metrics(config, api, render, log, tls)
    except BaseException:
        await api.store.aclose()
        raise
    return MetricsListener(server, bound, api)


async def serve_metrics(
    config: GatewayConfig,
    api: AdminApi,
    render: Callable[[], Awaitable[bytes]],
    log: AccessLog,
    tls: ssl.SSLContext | None,
) -> tuple[HttpServer, int]:
    """/metrics as `render` writes it (one EPP's, or the supervisor's merge of its
    workers': epp/supervisor.py) on admin_host:[epp] metrics_port, `api` checking the
    scrapers' tokens; the server and its port."""
    port = config.epp.metrics_port
    assert port is not None
    admin = _as_admin(config, port)
    return await start_admin_listener(AdminListener(admin, api, None, render, log), admin, tls)
