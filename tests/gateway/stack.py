"""A real stack for gateway tests: simulated replicas, a recording tap, and the gateway.

Everything talks HTTP over loopback. The tap sits between the gateway and each replica
and keeps the exact bytes the replica received, so tests can assert what reached it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import sqlite3
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from tests.support.gateways import metrics_token
from tests.support.http import async_client

from saltgate.config import (
    CanaryConfig,
    GatewayConfig,
    QueueConfig,
    ReplicaConfig,
    TracingConfig,
    create_master_key,
    load_master_key,
)
from saltgate.derivations.derive import cache_salt, derive_subkeys
from saltgate.gateway.canary import REQUEST_ID_PREFIX
from saltgate.http import HttpServer, Request, Response, UpstreamPool
from saltgate.policy.egress import MediaSettings
from saltgate.policy.forwarded import TrustedProxies
from saltgate.prices import Price
from saltgate.routing import RouterConfig
from saltgate.serving.run import RunningGateway, start_gateway
from saltgate.sim.run import RunningSim, SimConfig, start_sim
from saltgate.store.tenants import TenantStore

MODEL = "sim-model"
CANARY_ID = REQUEST_ID_PREFIX.encode()


@dataclass
class Tap:
    """A pass-through replica front that records every request it forwards."""

    target: RunningSim
    seen: list[Request] = field(default_factory=list)
    # The gateway's isolation canary requests (gateway/canary.py), kept apart from `seen`:
    # no tenant sent them.
    canary: list[Request] = field(default_factory=list)
    # Set by a test: rewrites each request body on its way to the replica (a leaky proxy).
    request: Callable[[bytes], bytes] | None = None
    server: HttpServer | None = None
    port: int = 0
    # Set by a test: rewrites each answer body and streamed chunk (a replica's extras).
    answer: Callable[[bytes], bytes] | None = None

    async def start(self) -> None:
        pool = UpstreamPool("127.0.0.1", self.target.port)

        async def handle(request: Request) -> Response:
            canary = (request.header(b"x-request-id") or b"").startswith(CANARY_ID)
            (self.canary if canary else self.seen).append(request)
            headers = [(k, v) for k, v in request.headers if k not in (b"host", b"content-length")]
            body = request.body if self.request is None else self.request(request.body)
            upstream = await pool.request(request.method, request.path, headers, body)
            if upstream.header(b"transfer-encoding") == b"chunked":
                kept = [(k, v) for k, v in upstream.headers if k != b"transfer-encoding"]
                return Response(upstream.status, kept, stream=self._rewritten(upstream.chunks()))
            body = await upstream.read()
            kept = [(k, v) for k, v in upstream.headers if k != b"content-length"]
            return Response(
                upstream.status, kept, body if self.answer is None else self.answer(body)
            )

        self.server = HttpServer(handle)
        self.port = await self.server.start("127.0.0.1", 0)
        self._pool = pool

    async def _rewritten(self, chunks: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
        async for chunk in chunks:
            yield chunk if self.answer is None else self.answer(chunk)

    async def close(self) -> None:
        assert self.server is not None
        await self.server.close()
        await self._pool.close()


@dataclass
class Stack:
    gateway: RunningGateway
    sims: list[RunningSim]
    taps: list[Tap]
    keys: dict[str, str]
    state_dir: Path

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.admin_port}/metrics"

    async def scrape(self) -> str:
        """/metrics from the admin listener, with a usage:read admin token (it takes one)."""
        async with async_client(timeout=30) as http:
            answer = await http.get(self.metrics_url, headers=self.metrics_headers)
        assert answer.status_code == 200, answer.text
        return answer.text

    @functools.cached_property
    def metrics_headers(self) -> dict[str, str]:
        return metrics_token(self.gateway.gateway.config.store_settings)

    def client(self, tenant: str | None = None, **kw: object) -> httpx.AsyncClient:
        headers = {"authorization": f"Bearer {self.keys[tenant]}"} if tenant else {}
        return async_client(base_url=self.url, headers=headers, timeout=30, **kw)

    def forwarded(self) -> list[Request]:
        """The generation requests replicas received (health probes left out)."""
        return [r for tap in self.taps for r in tap.seen if r.method == b"POST"]

    def seen_bodies(self) -> list[bytes]:
        return [r.body for r in self.forwarded()]

    def salt(self, tenant: str, secret: str | None = None) -> str:
        """The salt replicas must see on `tenant`'s requests (with `secret`, a user's),
        derived here from the master key, apart from the gateway."""
        k_salt = derive_subkeys(load_master_key(self.state_dir / "master.key")).salt
        with TenantStore.from_state_dir(self.state_dir) as store:
            found = store.get_tenant(tenant)
        return cache_salt(k_salt, found.id, found.epoch_label, secret)


def ledger_rows(s: Stack) -> list[sqlite3.Row]:
    """The usage ledger's records, oldest first."""
    conn = sqlite3.connect(s.state_dir / "saltgate.db")
    conn.row_factory = sqlite3.Row
    try:
        return list(conn.execute("SELECT * FROM usage ORDER BY rowid"))
    finally:
        conn.close()


def new_state_dir(state: Path, tenants: tuple[str, ...]) -> dict[str, str]:
    """A fresh state directory: a master key, and one tenant with one API key per name."""
    state.mkdir(mode=0o700)
    create_master_key(state / "master.key")
    keys = {}
    with TenantStore.from_state_dir(state) as store:
        for name in tenants:
            store.create_tenant(name)
            keys[name] = store.create_key(name)[1]
    return keys


@asynccontextmanager
async def stack(
    tmp: Path,
    *,
    replicas: int = 2,
    tenants: tuple[str, ...] = ("alice", "bob"),
    salting: bool = True,
    sim: SimConfig | None = None,
    models: tuple[str, ...] = (),
    max_body_bytes: int = 1024 * 1024,
    router: RouterConfig | None = None,
    require_encrypted_secret: bool = False,
    access_log: str = "off",
    log_format: str = "text",
    trusted_proxies: TrustedProxies | None = None,
    tracing: TracingConfig | None = None,
    workers: int = 1,
    limits_share: int = 1,
    limits_lease_ttl_s: float = 600.0,
    queue: QueueConfig | None = None,
    replica_priority_scheduling: bool = False,
    responses_store: bool = False,
    media: MediaSettings | None = None,
    canary: CanaryConfig | None = None,
) -> AsyncIterator[Stack]:
    """``models``: replica i serves models[i] (else every replica serves MODEL)."""
    base = sim or SimConfig(port=0)
    served = models or (base.model,) * replicas
    sims = [await start_sim(dataclasses.replace(base, model=m)) for m in served]
    taps = [Tap(s) for s in sims]
    for tap in taps:
        await tap.start()
    state = tmp / "state"
    keys = new_state_dir(state, tenants)
    config = GatewayConfig(
        replicas=tuple(ReplicaConfig(f"http://127.0.0.1:{t.port}") for t in taps),
        state_dir=state,
        master_key_file=state / "master.key",
        port=0,
        admin_port=0,
        max_body_bytes=max_body_bytes,
        prices={MODEL: Price(1.0, 0.1, 2.0)},
        salting=salting,
        router=router or RouterConfig(),
        require_encrypted_secret=require_encrypted_secret,
        access_log=access_log,
        log_format=log_format,
        trusted_proxies=trusted_proxies or TrustedProxies(),
        tracing=tracing,
        limits_share=limits_share,
        limits_lease_ttl_s=limits_lease_ttl_s,
        queue=queue or QueueConfig(),
        replica_priority_scheduling=replica_priority_scheduling,
        responses_store=responses_store,
        media=media or MediaSettings(),
        canary=canary or CanaryConfig(),
    )
    gateway = await start_gateway(config, workers=workers)
    try:
        yield Stack(gateway, sims, taps, keys, state)
    finally:
        await gateway.close()
        for tap in taps:
            await tap.close()
        for s in sims:
            await s.close()


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())  # type: ignore[arg-type]


def long_prompt(seed: str, words: int = 400) -> str:
    """Text long enough to fill many KV blocks; `seed` makes it unique."""
    return " ".join(f"{seed}{i}" for i in range(words))
