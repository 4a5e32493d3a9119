"""Assemble and run a gateway: `saltgate serve --config FILE` (and saltgate/demo.py's `up`).

Built in one direction: the gateway from its parts, the handler chain around it (the
EHBP edge when it is on), and the HTTP server last, around that chain. Closing runs the
other way: the server stops taking requests, then the gateway closes what it holds.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from saltgate.admin.api import AdminApi
from saltgate.admin.store import AdminStore
from saltgate.config import ConfigError, GatewayConfig, load_config, load_master_key
from saltgate.console.app import Console
from saltgate.derivations.derive import cluster_keys, derive_subkeys
from saltgate.ehbp.frames import KEYS_PATH, Keyring, ServerKey
from saltgate.gateway.access_log import AccessLog
from saltgate.gateway.admission import Admission
from saltgate.gateway.cluster import ClusterBus
from saltgate.gateway.ehbp import EhbpEdge, load_or_create_server_key, load_retired_keys
from saltgate.gateway.exchange import Meter
from saltgate.gateway.fairshare import FairShare, fair_queue
from saltgate.gateway.governor import Governance
from saltgate.gateway.host_limits import HostLimits
from saltgate.gateway.metrics import Metrics
from saltgate.gateway.replicas import ReplicaSet, tls_context
from saltgate.gateway.server import Gateway, error_response
from saltgate.gateway.shared_limits import connect_shared_limits
from saltgate.gateway.tracing import start_tracer
from saltgate.governance.limits import enforcement
from saltgate.http import Handler, HttpServer
from saltgate.kvevents.relay import KvRelay
from saltgate.kvevents.settings import KvUpstream
from saltgate.prices import PriceBook, price_versions
from saltgate.routing import Router
from saltgate.runtime import listen_error, run_service, until_stopped
from saltgate.serving import event_log
from saltgate.serving.acceptor import AcceptGate, Acceptor
from saltgate.serving.admin_listener import (
    AdminListener,
    admin_scheme,
    admin_tls,
    start_admin_listener,
)
from saltgate.serving.listener_tls import EdgeTls, edge_context
from saltgate.store.backends import open_gateway_store
from saltgate.store.errors import StoreError
from saltgate.store.usage_rollups import open_usage_reader

log = logging.getLogger(__name__)
INFERENCE_OPTIONS: Final = "the inference listener: gateway.host, gateway.port"


@dataclass(frozen=True, slots=True)
class SharedListener:
    """A listening socket the workers of `serve --workers N` share, and the gate that
    shares its connections among them (serving/balance.py)."""

    sock: socket.socket
    gate: AcceptGate


@dataclass
class RunningGateway:
    gateway: Gateway
    server: HttpServer  # serves the gateway's handler chain
    port: int
    metrics: Metrics
    admin: HttpServer | None
    admin_port: int | None
    ehbp: EhbpEdge | None = None
    kv_relay: KvRelay | None = None
    cluster: ClusterBus | None = None  # [cluster]: routing state shared over the bus
    admin_api: AdminApi | None = None  # /admin/v1/ on the admin listener
    console: Console | None = None  # /console/ on the admin listener
    edge_tls: EdgeTls | None = None  # TLS at the edge: the inference listener's certificate

    @property
    def url(self) -> str:
        return f"{edge_scheme(self.gateway.config)}://{self.gateway.config.host}:{self.port}"

    def reload(self, config: GatewayConfig) -> list[asyncio.Task[Any]]:
        """Apply a new [[replicas]] list without a restart (SIGHUP), to the router and to
        the KV-event relay's upstreams, and the edge's TLS files to new connections; other
        settings wait for the next start. Returns the added replicas' first probes, to
        await before saying the reload is done."""
        probes = self.gateway.reload(config)
        if self.edge_tls is not None:
            self.edge_tls.reload(config)
        elif config.tls_cert_file is not None:
            log.error("serving plain HTTP: turning TLS on (gateway.tls_cert_file) takes a restart")
        if self.kv_relay is not None:
            self.kv_relay.set_upstreams(kv_upstreams(config))
        return probes

    async def close(self) -> None:
        """Drain (SIGTERM): /ready says no at once, the listener closes, what is in flight
        has `drain_grace_s` to finish; then every answer still open is ended with an error
        event and its delivered tokens recorded (Gateway.cut_answers); then the rest."""
        gateway = self.gateway
        gateway.draining = True
        grace = gateway.config.drain_grace_s
        await self.server.close(grace, cut=gateway.cut_answers)
        if self.admin is not None:
            await self.admin.close()
        if self.admin_api is not None:
            await self.admin_api.store.aclose()
        await self.gateway.aclose()
        if self.kv_relay is not None:
            await asyncio.to_thread(self.kv_relay.close)


def edge_scheme(config: GatewayConfig) -> str:
    return "https" if config.tls_cert_file is not None else "http"


def kv_upstreams(config: GatewayConfig) -> list[KvUpstream]:
    """The replicas' KV-event endpoints, for the relay."""
    return [u for r in config.replicas if (u := r.kv_upstream) is not None]


def start_kv_relay(config: GatewayConfig, k_kv: bytes) -> KvRelay | None:
    """The KV-event relay of [kv_relay], started, or None when the section is absent.

    Its upstreams follow the replicas' event endpoints, at start and on each reload.
    """
    if config.kv_relay is None:
        return None
    relay = KvRelay(kv_upstreams(config), k_kv, config.kv_relay)
    relay.start()
    return relay


async def open_gateway(
    config: GatewayConfig,
    access_log: AccessLog,
    *,
    workers: int = 1,
    host_limits: socket.socket | None = None,
    bus: bool = False,
) -> Gateway:
    """The gateway from its parts (store, router, replicas, metrics, access log), not
    yet serving: `start_gateway` puts its HTTP server around it, `saltgate epp` its
    ext_proc server (saltgate/epp). ``host_limits``: see `start_gateway`; ``bus``: with
    [cluster], build the cluster bus (started by `start_gateway`).

    The one place governance is wired: the meter, the limits, the fair queue and the bus
    are built here and given to the replica set (its listeners) and the gateway."""
    tracer = start_tracer(config.tracing) if config.tracing is not None else None
    master_key = load_master_key(config.master_key_file)
    config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    subkeys = derive_subkeys(master_key)
    router = Router(config.router, subkeys.route)
    # The prices requests are reserved and billed at: the config's, the store's over them
    # as the key snapshot reloads them.
    configured = price_versions(config.prices)
    book = PriceBook(configured)
    store = await open_gateway_store(
        config.store_settings,
        busy=router.busy,  # under load, one commit carries the records about to finish
        outage_grace_s=config.store_outage_grace_s,
        prices=configured.values(),
        book=book,
    )
    metrics = Metrics()
    store.register_gauges(metrics.gauge)
    cluster_settings = config.cluster if bus else None
    queue = (
        fair_queue(config.queue, shared=cluster_settings is not None)
        if config.queue.enabled
        else None
    )
    cluster = (
        None
        if cluster_settings is None
        else ClusterBus(
            cluster_settings, router, cluster_keys(subkeys.route), metrics=metrics, fair=queue
        )
    )
    # [queue]: the saturation gate and the fair queue (docs/fairness.md); None: off.
    fair = (
        None
        if queue is None
        else FairShare(
            config.queue, metrics, queue, on_charge=None if cluster is None else cluster.changed
        )
    )
    listeners = [listener for listener in (cluster, fair) if listener is not None]
    replicas = ReplicaSet(
        config.replicas, timeout=config.upstream_timeout_s, router=router, listeners=listeners
    )
    meter = Meter(store.ledger, metrics, book, timeout_s=config.upstream_timeout_s)
    usage = open_usage_reader(config.store_settings)
    admission = Admission(
        book,
        share=config.limits_share * workers,
        shared=connect_shared_limits(config.cluster, lease_ttl_s=config.limits_lease_ttl_s)
        if config.cluster is not None
        else None
        if host_limits is None
        else await HostLimits.open(host_limits),
        lease_ttl_s=config.limits_lease_ttl_s,
        metrics=metrics,
        spend=usage,
    )
    return Gateway(
        config,
        subkeys=subkeys,
        keys=store.keys,
        ledger=store.ledger,
        replicas=replicas,
        metrics=metrics,
        access_log=access_log,
        store_down_for=store.unreachable_for,
        tracer=tracer,
        meter=meter,
        governance=Governance(admission, fair),
        cluster=cluster,
        usage=usage,
    )


async def start_gateway(
    config: GatewayConfig,
    *,
    listener: SharedListener | None = None,
    ehbp_keyring: Keyring | None = None,
    workers: int = 1,
    host_limits: socket.socket | None = None,
) -> RunningGateway:
    """Open the store, probe the replicas and serve: on `config`'s host and port, or (a
    worker, one of `workers`) on `listener` with the EHBP keys its parent gave every worker
    and (without [cluster]) `host_limits`, its channel to the supervisor's one count of the
    host's limits (gateway/host_limits.py)."""
    # The admin listener's refusal (plain HTTP off loopback) and TLS files first: nothing
    # is opened or bound when they stop the start.
    admin_context = admin_tls(config) if config.admin_port is not None else None
    edge = None if (context := edge_context(config)) is None else EdgeTls(context)
    access_log = AccessLog.open(config.access_log, config.log_format)
    gateway = await open_gateway(
        config, access_log, workers=workers, host_limits=host_limits, bus=True
    )
    metrics, replicas, subkeys = gateway.metrics, gateway.replicas, gateway.subkeys
    ehbp = _ehbp_edge(config, gateway, metrics, ehbp_keyring)
    handler: Handler = gateway.handle if ehbp is None else ehbp.handle
    # on_client_gone: "finish" lets an exchange run to its end when the client leaves,
    # so the replica's own usage is metered (gateway/exchange.py); "abort" cancels it.
    server = HttpServer(
        handler,
        max_body_bytes=config.max_body_bytes,
        error_response=error_response,
        cancel_on_disconnect=config.on_client_gone == "abort",
    )
    await replicas.probe_all()
    replicas.start_probing()
    if gateway.canary is not None:  # its first round before serving (docs/canary.md)
        await gateway.canary.run_all()
        gateway.canary.start()
    if listener is None:
        try:
            port = await server.start(config.host, config.port, tls=edge.context if edge else None)
        except OSError as exc:
            raise listen_error(INFERENCE_OPTIONS, config.host, config.port, exc) from None
    else:
        port = Acceptor(server, listener.sock, listener.gate, edge.context if edge else None).port
    admin = None
    admin_port = None
    admin_api = console = None
    if config.admin_port is not None:
        api = admin_api = AdminApi(
            AdminStore(config.store_settings), usage=gateway.usage, prices=config.prices
        )
        console = Console(
            api.service, metrics.snapshot, config, tls=config.admin_tls_cert_file is not None
        )

        async def render() -> bytes:
            return metrics.render()

        front = AdminListener(config, api, console, render, access_log)
        admin, admin_port = await start_admin_listener(front, config, admin_context)
    running = RunningGateway(
        gateway, server, port, metrics, admin, admin_port, ehbp, admin_api=admin_api
    )
    running.console = console
    running.edge_tls = edge
    try:
        running.cluster = gateway.cluster
        if gateway.cluster is not None:
            gateway.cluster.start()
        running.kv_relay = start_kv_relay(config, subkeys.kv_events)
    except BaseException:
        await running.close()
        raise
    return running


def _ehbp_edge(
    config: GatewayConfig, gateway: Gateway, metrics: Metrics, keyring: Keyring | None
) -> EhbpEdge | None:
    """The EHBP edge around the gateway's handler, serving EHBP beside plaintext with
    `keyring` or `ehbp_keyring(config)`; None when EHBP is off."""
    if not config.ehbp:
        return None
    return EhbpEdge(gateway.handle, keyring or ehbp_keyring(config), metrics)


def ehbp_keyring(config: GatewayConfig) -> Keyring:
    """The key file (made if absent), else a key made now, in memory only (a
    configuration built in code without one); with the retired keys still opened."""
    if config.ehbp_key_file is None:
        current = ServerKey.generate()
    else:
        current = load_or_create_server_key(config.ehbp_key_file)
    return Keyring(current, load_retired_keys(current, config.ehbp_retired_key_files))


def reread_config(path: Path) -> GatewayConfig | None:
    """The configuration file read again for a reload (SIGHUP); None, logged, if it is
    refused."""
    try:
        config = load_config(path)
        for index, replica in enumerate(config.replicas):
            tls_context(replica, index)  # TLS files that do not load refuse the reload here
        edge_context(config)  # so do the edge's
    except ConfigError as exc:
        log.error("reload refused, keeping the running replicas and certificate: %s", exc)
        return None
    return config


def _reload_from(running: RunningGateway, path: Path) -> None:
    """SIGHUP: reopen the access log (log rotation), then take the file's [[replicas]]."""
    if running.gateway.reopen_log():
        log.info("reopened the access log %s", running.gateway.config.access_log)
    config = reread_config(path)
    if config is None:
        return
    probes = running.reload(config)
    announced = asyncio.get_running_loop().create_task(_announce_reload(probes, path, config))
    _RELOADS.add(announced)
    announced.add_done_callback(_RELOADS.discard)


_RELOADS: set[asyncio.Task[None]] = set()  # announcements under way (tasks need a holder)


async def _announce_reload(
    probes: list[asyncio.Task[Any]], path: Path, config: GatewayConfig
) -> None:
    """Say the reload is done once the added replicas have answered their first probe
    (each bounded by probe_timeout_s), so a replaced list is serving when it is said."""
    await asyncio.gather(*probes, return_exceptions=True)
    log.info("reloaded %s: %d replicas", path, len(config.replicas))


def announce(
    config: GatewayConfig,
    url: str,
    *,
    admin_port: int | None,
    ehbp_fingerprint: str | None,
    parts: tuple[str | None, ...],
    workers: int | None = None,
) -> None:
    """The lines an operator reads at start: where it serves, where metrics are, the EHBP
    key clients pin, how the tenants' limits are held (and where not exactly), and a line
    per running part (relay, cluster bus)."""
    served = f"{len(config.replicas)} replicas" + (f", {workers} workers" if workers else "")
    print(f"saltgate: serving on {url} ({served})", flush=True)
    if admin_port is not None:
        admin = f"{admin_scheme(config)}://{config.admin_host}:{admin_port}"
        print(f"saltgate: metrics on {admin}/metrics (an admin token with usage:read)")
        print(f"saltgate: admin API on {admin}/admin/v1/")
    if ehbp_fingerprint is not None:
        print(f"saltgate: EHBP key {ehbp_fingerprint} at {KEYS_PATH}")
    held = enforcement(
        workers=workers or 1, gateways=config.limits_share, cluster=config.cluster is not None
    )
    print(f"saltgate: {held} (docs/limits.md)")
    for part in parts:
        if part is not None:
            print(f"saltgate: {part}", flush=True)


async def _serve(config: GatewayConfig) -> None:
    event_log.configure(config.log_format)
    running = await start_gateway(config)
    announce(
        config,
        running.url,
        admin_port=running.admin_port,
        ehbp_fingerprint=running.ehbp.keyring.current.config.fingerprint if running.ehbp else None,
        parts=(
            running.kv_relay.describe() if running.kv_relay else None,
            running.cluster.describe() if running.cluster else None,
        ),
    )
    if config.config_file is not None:
        path = config.config_file
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, _reload_from, running, path)
    await until_stopped()
    log.info(
        "stopping: no new connections; requests in flight have %g s to finish",
        config.drain_grace_s,
    )
    await running.close()
    log.info("stopped")


def serve(config: GatewayConfig) -> int:
    return run_service(
        lambda: _serve(config),
        "saltgate",
        cannot_run=f"cannot serve on {config.host}:{config.port}",
        usage_errors=(ConfigError, StoreError),
    )
