"""The cluster bus: a gateway's routing state (and, with [queue], the service its fair
queue charged each tenant) to and from the other gateways, over Redis.

The deciding part is pure (routing/cluster.py: what a batch holds, what applying one
does); this module is its I/O. When the router changes (the replica set says so) it
takes the batch gathered since the last one and appends it to a Redis stream (XADD,
capped at STREAM_MAX_BATCHES entries), at most one per ``publish_interval_s``; one
reader follows the stream (XREAD BLOCK) and applies the other gateways' batches. Nothing
here runs on a request's path: a request only appends its placement to a list in the
router and sets a flag.

Why a stream and not pub/sub: a gateway that starts, or comes back after losing the
bus, reads what the others wrote meanwhile (the last ``affinity_ttl_s`` of it, bounded by
the cap) instead of starting blind; entries carry Redis's own time, so a catching-up
gateway knows how old each placement and backlog is.

When Redis cannot be reached the gateway routes on its own state: the others' backlogs
are dropped at once, placements already learnt stay until their TTL, and its own wait
(bounded) to be sent on return. `saltgate_cluster_bus_up` says which; the bus is retried
every half second to five seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import socket
import time
from typing import Any, Final

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from saltgate.config import ConfigError, read_secret_file
from saltgate.derivations.derive import ClusterKeys
from saltgate.gateway.metrics import Metrics
from saltgate.gateway.replicas import ReplicaSet
from saltgate.routing import ReplicaId, Router
from saltgate.routing.cluster import HEARTBEAT_S, ClusterSettings, ClusterState, FairCounters

log = logging.getLogger(__name__)

STREAM_MAX_BATCHES: Final = 20_000  # approximate cap (XADD MAXLEN ~)
FIELD: Final = b"b"
READ_BLOCK_MS: Final = 1000
READ_COUNT: Final = 1024
RETRY_MIN_S: Final = 0.5
RETRY_MAX_S: Final = 5.0
CONNECT_TIMEOUT_S: Final = 2.0
SOCKET_TIMEOUT_S: Final = 5.0  # above READ_BLOCK_MS: a blocked read is not a dead server


def bus_password(settings: ClusterSettings) -> str | None:
    """The bus's password, read now (a rotated file is used from the next connection);
    ConfigError names the file or variable, never the value."""
    if settings.password_file is not None:
        data = read_secret_file(settings.password_file, "cluster.password_file")
        text = data.decode("utf-8", errors="replace").strip()
        if not text:
            raise ConfigError(f"cluster.password_file: {settings.password_file} is empty")
        return text
    if settings.password_env is not None:
        value = os.environ.get(settings.password_env)
        if not value:
            raise ConfigError(
                f"cluster.password_env: environment variable {settings.password_env} is not set"
            )
        return value
    return None


def sender_id(gateway_id: str | None) -> str:
    """This process on the bus: the gateway id (else the host's name) and 32 random bits,
    so two processes never share one, whatever their ids and pids."""
    name = gateway_id or re.sub(r"[^A-Za-z0-9._:-]", "-", socket.gethostname())[:64] or "gateway"
    return f"{name}/{secrets.token_hex(4)}"


class ClusterBus:
    """One gateway process's connection to the bus; `start`, then `close`."""

    def __init__(
        self,
        settings: ClusterSettings,
        router: Router,
        keys: ClusterKeys,
        *,
        metrics: Metrics | None = None,
        fair: FairCounters | None = None,
    ) -> None:
        """``fair``: the fair queue's counters ([queue]), which become the fleet's."""
        self.settings = settings
        self.keys = keys
        self.sender = sender_id(settings.gateway_id)
        self.state = ClusterState(
            router, keys, self.sender, backlog_ttl_s=settings.backlog_ttl_s, fair=fair
        )
        self.metrics = metrics or Metrics()
        self.up = False
        self._down_since: float | None = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self._client: Redis | None = None
        self._wake = asyncio.Event()
        self._closing = False
        self._last_id = b""
        self._connected_before = False
        self._said_down = False
        self._clock_offset_s = 0.0  # Redis's clock minus ours
        self._describe()

    def _describe(self) -> None:
        m = self.metrics
        m.describe(
            "saltgate_cluster_batches_total",
            "counter",
            "Cluster bus batches by kind: sent, received (applied), rejected (tag or format).",
        )
        m.gauge(
            "saltgate_cluster_bus_up",
            "1 while the cluster bus answers; 0: routing on this gateway's own state.",
            lambda: [((), 1.0 if self.up else 0.0)],
        )
        m.gauge(
            "saltgate_cluster_bus_down_seconds",
            "Seconds since the cluster bus was lost (0 while it answers).",
            lambda: [((), self.down_for())],
        )
        m.gauge(
            "saltgate_cluster_peers",
            "Other gateway processes heard on the bus within backlog_ttl_s.",
            lambda: [((), float(self.state.peers))],
        )

    def down_for(self) -> float:
        return 0.0 if self._down_since is None else time.monotonic() - self._down_since

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Check the credentials now (a missing file is a configuration error), then
        connect in the background: a gateway starts and serves without its bus."""
        bus_password(self.settings)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="cluster-bus")

    async def close(self) -> None:
        """Stop for good. The client library may turn a cancellation it receives in the
        middle of a command into a connection error, which the loop would take for a
        lost bus and retry: so the loop also checks ``_closing``, and is cancelled until
        it has ended."""
        self._closing = True
        task, self._task = self._task, None
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)
        await self._drop_client()

    def describe(self) -> str:
        return f"cluster bus {self.settings.url} as {self.sender}"

    # -- the connection ---------------------------------------------------------------------
    async def _run(self) -> None:
        delay = RETRY_MIN_S
        while not self._closing:
            try:
                client = await self._connect()
                delay = RETRY_MIN_S
                await self._serve(client)
            except (RedisError, OSError, ConfigError) as exc:
                self._lost(exc)
            await self._drop_client()
            dropped = self.state.trim_pending()
            if dropped:
                log.warning("cluster bus: %d placements dropped while it was down", dropped)
            await asyncio.sleep(delay)
            delay = min(RETRY_MAX_S, delay * 2)

    async def _drop_client(self) -> None:
        """Close the connection, if any, without ever waiting long on a dead server."""
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                await asyncio.wait_for(client.aclose(), CONNECT_TIMEOUT_S)

    async def _connect(self) -> Redis:
        client: Redis = Redis.from_url(
            self.settings.url,
            password=bus_password(self.settings),
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            socket_timeout=SOCKET_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
            client_name=f"saltgate-{self.sender.replace('/', '-')}",
        )
        self._client = client
        seconds, micros = await client.time()
        self._clock_offset_s = seconds + micros / 1e6 - time.time()
        if not self._last_id:
            # First connection: what the others placed within the affinity TTL.
            since_ms = int((time.time() + self._clock_offset_s) * 1000)
            since_ms -= int(self.state.router.config.affinity_ttl_s * 1000)
            self._last_id = f"{max(0, since_ms)}-0".encode()
        if self._connected_before:
            log.warning(
                "cluster bus %s: back after %.1f s, sharing again",
                self.settings.url,
                self.down_for(),
            )
        else:
            log.info("cluster bus %s: connected", self.settings.url)
        self._connected_before = True
        self._said_down = False
        self.up = True
        self._down_since = None
        return client

    def _lost(self, exc: BaseException) -> None:
        if self.up or not self._said_down:
            log.warning(
                "cluster bus %s unreachable (%s): routing on this gateway's own state",
                self.settings.url,
                type(exc).__name__,
            )
            self._said_down = True
        if self.up:
            self._down_since = time.monotonic()
        self.up = False
        self.state.forget_peers()

    async def _serve(self, client: Redis) -> None:
        """Publish and read until either fails; the failure ends both."""
        tasks = [
            asyncio.create_task(self._publish(client)),
            asyncio.create_task(self._read(client)),
        ]
        failure: BaseException | None = None
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except BaseException as exc:
            failure = exc  # both stopped below, outside the handler (buildinfo.py)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if failure is not None:
            raise failure
        for task in tasks:
            if not task.cancelled() and (error := task.exception()) is not None:
                raise error

    def changed(self) -> None:
        """The router placed a request or its backlog moved, or the fair queue charged a
        tenant: publish soon (called on the request path: it only sets a flag)."""
        self._wake.set()

    # -- the replica set's listener (gateway/replicas.py ReplicaListener) ----------------
    def acquired(self) -> None:
        self._wake.set()

    def freed(self, replicas: ReplicaSet) -> None:
        self._wake.set()

    def queue_seen(
        self,
        replicas: ReplicaSet,
        replica: ReplicaId,
        *,
        inflight: int,
        waiting: float | None,
        running: float | None,
        step: int | None,
    ) -> None:
        """Probes are each gateway's own: nothing to publish."""

    async def _publish(self, client: Redis) -> None:
        """A batch as soon as something changed, at most one per ``publish_interval_s``,
        one XADD in flight at a time (what changes meanwhile goes in the next), and a
        heartbeat while nothing does. Prompt matters: a burst of requests spread over
        the gateways is decided in parallel, and each gateway should see the others'
        choices within the burst (docs/routing.md, "Several gateways")."""
        interval = self.settings.publish_interval_s
        wake = self._wake
        while True:
            if not wake.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), HEARTBEAT_S / 2)
            wake.clear()
            now = time.monotonic()
            self.state.expire(now)
            batch = self.state.outgoing(now)
            if batch is not None:
                await client.xadd(
                    self.keys.stream, {FIELD: batch}, maxlen=STREAM_MAX_BATCHES, approximate=True
                )
                self._count("sent", 1)
            rest = interval - (time.monotonic() - now)
            if rest > 0:
                await asyncio.sleep(rest)

    async def _read(self, client: Redis) -> None:
        stream = self.keys.stream
        while True:
            reply: Any = await client.xread(
                {stream: self._last_id}, count=READ_COUNT, block=READ_BLOCK_MS
            )
            received = rejected = 0
            for _name, entries in reply or ():
                for entry_id, fields in entries:
                    self._last_id = entry_id
                    data = fields.get(FIELD)
                    if not isinstance(data, bytes):
                        rejected += 1
                        continue
                    before = self.state.rejected
                    batch = self.state.incoming(data, time.monotonic(), self._age(entry_id))
                    if self.state.rejected != before:
                        rejected += 1
                    elif batch is not None:
                        received += 1
            if received:
                self._count("received", received)
            if rejected:
                self._count("rejected", rejected)
                log.warning("cluster bus: %d batches did not verify and were dropped", rejected)

    def _age(self, entry_id: bytes) -> float:
        """Seconds since Redis stored the entry (its id starts with Redis's time in ms)."""
        try:
            written_ms = int(entry_id.split(b"-", 1)[0])
        except ValueError:
            return 0.0
        return max(0.0, time.time() + self._clock_offset_s - written_ms / 1000.0)

    def _count(self, kind: str, n: int) -> None:
        self.metrics.inc("saltgate_cluster_batches_total", (("kind", kind),), n)
