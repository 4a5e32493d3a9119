"""`saltgate-bench replay --gateways N`: the replay through a fleet of gateways.

The same trace, schedule, tenants and simulated replicas as the one-gateway replay; in
front of the replicas, N `saltgate serve` processes behind HAProxy (round robin per
request: the worst case for state kept in one process; saltgate_devkit/services.py says how),
all on one PostgreSQL store, and, with shared state on, on one Redis cluster bus
(docs/deployment.md). Every variant, including one gateway, goes through the balancer
and the PostgreSQL store, so the variants differ only in the gateways.

`--kill-gateway-at S` SIGKILLs one gateway S seconds in: HAProxy's health check takes it
out, requests it was serving fail, new ones go to the others. Afterwards the ledger is
matched against the responses one by one: each response delivered with a 200 carries
`x-request-id`, which is its usage record's `request_id`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from saltgate.governance.limits import Limits
from saltgate_bench.gateway_setup import (
    GatewayState,
    gateway_config,
    prepare_gateway_state,
    serve_argv,
    write_gateway_config,
)
from saltgate_bench.procs import (
    BenchError,
)
from saltgate_bench.replay_client import RequestShape
from saltgate_bench.replay_metrics import Outcome
from saltgate_bench.replay_procs import wait_ready
from saltgate_devkit.procs import Proc, free_port
from saltgate_devkit.services import HaproxyServer, PostgresServer, RedisServer, ServiceError


@dataclass(frozen=True, slots=True)
class FleetOptions:
    gateways: tuple[int, ...]
    shared_state: tuple[bool, ...]
    kill_gateway_at_s: float | None = None
    kill_gateway: int = 0

    def variants(self) -> list[tuple[int, bool]]:
        """(gateways, shared state) in the order they run. One gateway shares with
        nobody, so it runs once, without the bus, unless only "on" was asked for."""
        out = []
        for n in self.gateways:
            for shared in self.shared_state:
                if n == 1 and shared and False in self.shared_state:
                    continue
                out.append((n, shared))
        return out

    @property
    def needs_bus(self) -> bool:
        return any(shared for _, shared in self.variants())


class FleetServices:
    """One PostgreSQL (a fresh database per variant) and, if a variant shares state, one
    Redis, for the whole invocation; both on loopback, started and removed here."""

    def __init__(self, need_bus: bool) -> None:
        self.postgres: PostgresServer | None = None
        self.redis: RedisServer | None = None
        try:
            self.postgres = PostgresServer()
            self.postgres.start()
            if need_bus:
                self.redis = RedisServer()
                self.redis.start()
        except ServiceError as exc:
            self.stop()
            raise BenchError(str(exc)) from None

    def new_store_state(
        self, state_dir: Path, tenants: Sequence[str], limits: Limits | None = None
    ) -> GatewayState:
        """A fresh database with the tenants, their keys (and limits), and a master key
        in state_dir."""
        assert self.postgres is not None
        name = f"replay_{secrets.token_hex(4)}"
        self.postgres.create_database(name)
        store = self.postgres.settings(name, state_dir.parent / f"{state_dir.name}-spool")
        return prepare_gateway_state(state_dir, tenants, store, limits)

    def stop(self) -> None:
        for server in (self.redis, self.postgres):
            if server is not None:
                with contextlib.suppress(ServiceError):
                    server.destroy()


class GatewayFleet:
    """N `saltgate serve` processes on one store (and bus), HAProxy in front."""

    def __init__(
        self,
        count: int,
        state: GatewayState,
        replica_urls: Sequence[str],
        *,
        policy: str,
        router_settings: Sequence[str],
        bus: RedisServer | None,
        workdir: Path,
        tag: str,
        sections: str = "",
    ) -> None:
        self.procs: list[Proc | None] = []
        self.ports: list[int] = []
        self.balancer: HaproxyServer | None = None
        for i in range(count):
            port = free_port()
            text = gateway_config(
                state,
                replica_urls,
                port=port,
                admin_port=free_port(),
                policy=policy,
                router_settings=router_settings,
                cluster=bus.settings(f"gw{i}") if bus is not None else None,
                sections=sections,
            )
            config = write_gateway_config(workdir / f"{tag}-gw{i}.toml", text)
            self.procs.append(
                Proc(f"{tag}-gw{i}", serve_argv(config), workdir / f"{tag}-gw{i}.log")
            )
            self.ports.append(port)

    async def start(self, shape: RequestShape, timeout_s: float) -> int:
        """Wait for every gateway, then start the balancer; returns its port."""
        for proc, port in zip(self.procs, self.ports, strict=True):
            assert proc is not None
            await wait_ready(proc, port, shape, timeout_s)
        try:
            self.balancer = HaproxyServer(self.ports)
            self.balancer.start()
        except ServiceError as exc:
            raise BenchError(str(exc)) from None
        first = self.procs[0]
        assert first is not None
        await wait_ready(first, self.balancer.port, shape, timeout_s)
        return self.balancer.port

    def kill(self, i: int) -> None:
        """SIGKILL gateway i (its process group), as a crashed node would die."""
        proc = self.procs[i]
        if proc is not None:
            proc.kill()
            self.procs[i] = None

    def stop(self) -> None:
        if self.balancer is not None:
            self.balancer.destroy()
        for proc in self.procs:
            if proc is not None:
                proc.stop()


async def kill_gateway_later(
    fleet: GatewayFleet, which: int, at_s: float, record: dict[str, Any], t0: float
) -> None:
    """SIGKILL gateway ``which`` ``at_s`` after the schedule's start ``t0``; the time
    recorded is when the signal went, on the replay's clock (what `killed_in_flight`
    compares the outcomes' times with)."""
    await asyncio.sleep(max(0.0, t0 + at_s - time.monotonic()))
    record["killed_at_s"] = round(time.monotonic() - t0, 3)
    fleet.kill(which)


def ledger_check(
    postgres: PostgresServer, database: str, outcomes: Sequence[Outcome | None]
) -> dict[str, Any]:
    """Each response delivered with a 200 matched to its usage record by request id."""
    delivered = [o.request_id for o in outcomes if o is not None and o.ok and o.request_id]
    unnamed = sum(1 for o in outcomes if o is not None and o.ok and not o.request_id)
    with postgres.connect(database) as conn:
        rows = conn.execute(
            "SELECT request_id, count(*) FROM usage WHERE request_id = ANY(%s) GROUP BY request_id",
            (delivered,),
        ).fetchall()
        total_row = conn.execute("SELECT count(*) FROM usage").fetchone()
    counts = {str(rid): int(str(n)) for rid, n in rows}
    return {
        "delivered_200": len(delivered) + unnamed,
        "without_request_id": unnamed,
        "with_one_record": sum(1 for rid in delivered if counts.get(rid) == 1),
        "without_record": sum(1 for rid in delivered if rid not in counts),
        "with_several_records": sum(1 for rid in delivered if counts.get(rid, 0) > 1),
        "records_in_ledger": int(str(total_row[0])) if total_row else 0,
    }


def killed_in_flight(
    outcomes: Sequence[Outcome | None], killed_at_s: float | None
) -> dict[str, Any]:
    """What was in flight when the gateway died (on any gateway: the client cannot tell
    which one served a request), and which failures were not among those."""
    if killed_at_s is None:
        return {}
    in_flight = [
        o
        for o in outcomes
        if o is not None and o.sent_at <= killed_at_s and (o.done_at or 0.0) >= killed_at_s
    ]
    failed = [o for o in outcomes if o is not None and not o.ok]
    return {
        "in_flight_at_kill": len(in_flight),
        "failed_in_flight_at_kill": sum(1 for o in in_flight if not o.ok),
        "failed_otherwise": sum(1 for o in failed if o not in in_flight),
    }


def variant_label(policy: str, gateways: int, shared: bool) -> str:
    """How a variant is named in logs, the table and the plot."""
    return f"{policy} x{gateways} {'shared' if shared else 'alone'}"


def database_of(state: GatewayState) -> str:
    assert state.store is not None
    return state.store.url.rsplit("/", 1)[1]
