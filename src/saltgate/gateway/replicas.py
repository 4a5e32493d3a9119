"""The gateway's view of its replicas: connection pools, in-flight counts, health.

Until the cache-aware router lands, a request goes to the least-loaded healthy replica.
A replica that fails a connection is marked down; a background probe of /health brings
it back. The probe also learns the models the replicas serve, for GET /v1/models.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import orjson

from saltgate.config import ReplicaConfig
from saltgate.http.client import UpstreamError, UpstreamPool

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Replica:
    index: int
    config: ReplicaConfig
    pool: UpstreamPool
    prefix: bytes
    auth: list[tuple[bytes, bytes]]
    inflight: int = 0
    healthy: bool = True
    models: list[dict[str, Any]] = field(default_factory=list)


class ReplicaSet:
    def __init__(self, configs: tuple[ReplicaConfig, ...], *, timeout: float) -> None:
        self.replicas: list[Replica] = []
        for i, cfg in enumerate(configs):
            host, port, prefix = cfg.authority
            auth = [(b"authorization", b"Bearer " + cfg.api_key.encode())] if cfg.api_key else []
            pool = UpstreamPool(host, port, response_timeout=timeout, read_timeout=timeout)
            self.replicas.append(Replica(i, cfg, pool, prefix.encode(), auth))
        self._probe_task: asyncio.Task[None] | None = None
        self._turn = 0

    def pick(self, exclude: set[Replica]) -> Replica | None:
        """Least in-flight among healthy replicas not yet tried; rotate among equals."""
        best: Replica | None = None
        n = len(self.replicas)
        self._turn = (self._turn + 1) % n
        for k in range(n):
            replica = self.replicas[(self._turn + k) % n]
            if not replica.healthy or replica in exclude:
                continue
            if best is None or replica.inflight < best.inflight:
                best = replica
        return best

    def mark_down(self, replica: Replica) -> None:
        if replica.healthy:
            log.warning("replica %d marked down", replica.index)
        replica.healthy = False

    def models(self) -> list[dict[str, Any]]:
        seen: dict[str, dict[str, Any]] = {}
        for replica in self.replicas:
            for model in replica.models:
                seen.setdefault(str(model.get("id")), model)
        return list(seen.values())

    async def probe(self, replica: Replica) -> bool:
        try:
            resp = await replica.pool.request(b"GET", replica.prefix + b"/health", replica.auth)
            await resp.read()
            ok = resp.status == 200
            if ok:
                resp = await replica.pool.request(
                    b"GET", replica.prefix + b"/v1/models", replica.auth
                )
                body = await resp.read()
                if resp.status == 200:
                    replica.models = _model_entries(body)
        except UpstreamError:
            ok = False
        if ok and not replica.healthy:
            log.info("replica %d is back", replica.index)
        replica.healthy = ok
        return ok

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(r) for r in self.replicas))

    def start_probing(self, interval: float) -> None:
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
        for replica in self.replicas:
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
