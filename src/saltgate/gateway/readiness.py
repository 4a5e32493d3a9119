"""`GET /ready`: whether a balancer should send this gateway process requests now.

`/health` says the process answers (liveness: restart it if not); `/ready` says it can
serve: its store answers, or is out of reach for less than `store_outage_grace_s` (the
gateway authenticates from the keys it knows meanwhile), and at least one replica is
healthy (its probes pass and its breaker lets requests by: the router's own view, no
probe of its own). `?model=NAME` asks the same for one model: a healthy replica must list
it in its /v1/models. Each process of `serve --workers N` answers for itself.

The answer is decided here, from what the gateway knows, without I/O. Its body names
replicas by their index in the configuration, as the metrics do, never by URL or key: it
is served unauthenticated on the inference port.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

STORE_OK: Final = "ok"
STORE_DEGRADED: Final = "degraded"  # out of reach, within its grace: still serving
STORE_UNREACHABLE: Final = "unreachable"  # out of reach past its grace: refusing (503)


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What readiness needs of one replica: the router's health, the models it lists."""

    healthy: bool
    models: tuple[str, ...]
    # Why it is down, when known: credentials_refused (it refuses the gateway's API key),
    # isolation_canary_failed, probe_failed.
    reason: str | None = None


def store_state(down_s: float, grace_s: float) -> str:
    """The store as /ready reports it, by the rule authentication follows (PgKeyIndex)."""
    if down_s <= 0:
        return STORE_OK
    return STORE_DEGRADED if down_s <= grace_s else STORE_UNREACHABLE


def readiness(
    store_down_s: float,
    grace_s: float,
    replicas: Sequence[ReplicaView],
    model: str | None = None,
    *,
    draining: bool = False,
) -> tuple[bool, dict[str, Any]]:
    """(ready, the JSON body): ready unless the process is draining (SIGTERM: it finishes
    what it has and takes nothing new), the store is past its grace, no replica is
    healthy, or `model` is asked for and no healthy replica lists it."""
    store = store_state(store_down_s, grace_s)
    healthy = sum(r.healthy for r in replicas)
    models: dict[str, bool] = {}
    for replica in replicas:
        for name in replica.models:
            models[name] = models.get(name, False) or replica.healthy
    ready = not draining and store != STORE_UNREACHABLE and healthy > 0
    if model is not None:
        models.setdefault(model, False)
        ready = ready and models[model]
    body = {
        "ready": ready,
        "draining": draining,
        "store": store,
        "store_down_s": round(store_down_s, 3),
        "replicas": {
            "healthy": healthy,
            "total": len(replicas),
            "list": [
                {"replica": i, "healthy": r.healthy}
                | ({} if r.healthy or r.reason is None else {"reason": r.reason})
                for i, r in enumerate(replicas)
            ],
        },
        "models": models,
    }
    return ready, body
