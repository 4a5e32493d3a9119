"""The gateway's replicas: connection pools and probes around the sans-IO router.

The router (saltgate.routing) decides; this module does the I/O it needs: a pooled
connection per replica, /health, /v1/models and /metrics probes every
``probe_interval_s``, and a replica set that can change while requests are in flight
(`reload`): a removed replica's pool closes once its last request has finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from saltgate.config import ReplicaConfig
from saltgate.http.client import UpstreamError, UpstreamPool
from saltgate.routing import Member, Plan, ReplicaState, Router, parse_waiting
from saltgate.spec.derive import Prompt

log = logging.getLogger(__name__)

RETIRE_POLL_S = 0.1


@dataclass(slots=True, eq=False)
class Replica:
    config: ReplicaConfig
    pool: UpstreamPool
    prefix: bytes
    models: list[dict[str, Any]] = field(default_factory=list)
    # The replica's identity in the ranking: its URL, the same on every gateway.
    id: str = field(init=False)
    auth: list[tuple[bytes, bytes]] = field(init=False, repr=False)  # with its backend key

    def __post_init__(self) -> None:
        self.id = self.config.url
        self.configure(self.config)

    def configure(self, config: ReplicaConfig) -> None:
        """Take a reloaded configuration of the same URL (its backend key may change)."""
        self.config = config
        key = config.api_key
        self.auth = [(b"authorization", b"Bearer " + key.encode())] if key else []


class ReplicaSet:
    def __init__(
        self, configs: tuple[ReplicaConfig, ...], *, timeout: float, router: Router
    ) -> None:
        self.router = router
        self.timeout = timeout
        self._replicas: dict[str, Replica] = {}
        self._probe_task: asyncio.Task[None] | None = None
        self._retiring: set[asyncio.Task[None]] = set()
        self.reload(configs)

    @property
    def replicas(self) -> list[Replica]:
        """In configuration order."""
        return list(self._replicas.values())

    # -- membership ------------------------------------------------------------------------
    def reload(self, configs: tuple[ReplicaConfig, ...]) -> None:
        """Switch to a new replica list without a restart; replicas that stay keep their
        pools, load and health, and removed ones finish what they are serving."""
        replicas: dict[str, Replica] = {}
        for cfg in configs:
            replica = self._replicas.get(cfg.url)
            if replica is None:
                host, port, prefix = cfg.authority
                pool = UpstreamPool(
                    host, port, response_timeout=self.timeout, read_timeout=self.timeout
                )
                replica = Replica(cfg, pool, prefix.encode())
            replica.configure(cfg)
            replicas[cfg.url] = replica
        self.router.set_members(Member(cfg.url, cfg.weight) for cfg in configs)
        removed = [r for url, r in self._replicas.items() if url not in replicas]
        self._replicas = replicas
        for replica in removed:
            task = asyncio.get_running_loop().create_task(self._retire(replica))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def _retire(self, replica: Replica) -> None:
        deadline = time.monotonic() + self.timeout
        try:
            while self.router.inflight(replica.id) > 0 and time.monotonic() < deadline:
                await asyncio.sleep(RETIRE_POLL_S)
        finally:
            await replica.pool.close()

    # -- decisions and the events that feed them -----------------------------------------
    def plan(
        self, route: str, body: Mapping[str, Any], model: str, salt: str | None, *, remember: bool
    ) -> Plan:
        """A request's routing input: its route key and prefix digests, under the policy;
        ``remember``: whether the router may keep the salt's keyed states (`Router.namespace`)."""
        router = self.router
        prompt = Prompt(body, route)
        keys = router.namespace(model, salt, remember=remember)
        key = router.request_key(prompt, keys)
        return router.plan(key, time.monotonic(), router.prefixes(prompt, keys))

    def pick(self, plan: Plan, tried: set[str]) -> Replica | None:
        replica_id = self.router.pick(plan, time.monotonic(), tried)
        return None if replica_id is None else self._replicas[replica_id]

    def started(self, replica: Replica, plan: Plan) -> float:
        """Count the request on the replica; returns its prefill estimate there, which
        `prefilled` (first output) or `finished` hands back."""
        prefill = float(plan.uncached_bytes(replica.id))
        self.router.started(replica.id, time.monotonic(), prefill)
        return prefill

    def responded(self, replica: Replica) -> None:
        self.router.responded(replica.id)

    def prefilled(self, replica: Replica, prefill: float) -> None:
        self.router.prefilled(replica.id, prefill)

    def failed(self, replica: Replica) -> None:
        self.router.failed(replica.id, time.monotonic())

    def finished(self, replica: Replica, prefill: float = 0.0) -> None:
        self.router.finished(replica.id, prefill)

    def available(self) -> list[tuple[int, Replica, bool]]:
        """(index in the configuration, replica, may be picked now) for the metrics."""
        now = time.monotonic()
        return [
            (i, r, self._state(r).health.available(now))
            for i, r in enumerate(self._replicas.values())
        ]

    def _state(self, replica: Replica) -> ReplicaState:
        state = self.router.state(replica.id)
        assert state is not None, "the router and the replica set list the same replicas"
        return state

    def models(self) -> list[dict[str, Any]]:
        seen: dict[str, dict[str, Any]] = {}
        for replica in self._replicas.values():
            for model in replica.models:
                seen.setdefault(str(model.get("id")), model)
        return list(seen.values())

    # -- probes ----------------------------------------------------------------------------
    async def probe(self, replica: Replica) -> bool:
        try:
            ok = await asyncio.wait_for(self._probe(replica), self.router.config.probe_timeout_s)
        except (UpstreamError, TimeoutError):
            ok = False
        state = self.router.state(replica.id)
        if state is None:
            return ok  # removed while the probe ran
        was_up = state.health.probe.up
        self.router.probed(replica.id, ok)
        if state.health.probe.up != was_up:
            index = self.replicas.index(replica)
            log.warning("replica %d is %s", index, "back" if ok else "down: its probes fail")
        return ok

    async def _probe(self, replica: Replica) -> bool:
        resp = await replica.pool.request(b"GET", replica.prefix + b"/health", replica.auth)
        await resp.read()
        if resp.status != 200:
            return False
        resp = await replica.pool.request(b"GET", replica.prefix + b"/v1/models", replica.auth)
        body = await resp.read()
        if resp.status == 200:
            replica.models = _model_entries(body)
        resp = await replica.pool.request(b"GET", replica.prefix + b"/metrics", replica.auth)
        body = await resp.read()
        self.router.observed_queue(replica.id, parse_waiting(body) if resp.status == 200 else None)
        return True

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(r) for r in self.replicas))

    def start_probing(self) -> None:
        interval = self.router.config.probe_interval_s

        async def loop() -> None:
            while True:
                await asyncio.sleep(interval)
                await self.probe_all()

        self._probe_task = asyncio.get_running_loop().create_task(loop())

    async def close(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
        retiring = list(self._retiring)
        for task in retiring:
            task.cancel()
        await asyncio.gather(*retiring, return_exceptions=True)
        for replica in self._replicas.values():
            await replica.pool.close()


def _model_entries(body: bytes) -> list[dict[str, Any]]:
    """Model ids and public fields only: nothing that would name the replica."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return []
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return []
    return [
        {"id": m["id"], "object": "model", "created": m.get("created", 0), "owned_by": "saltgate"}
        for m in data
        if isinstance(m, dict) and isinstance(m.get("id"), str)
    ]
