"""The shared limits engine on a real Redis: one atomic script per admission, so
concurrent gateways never admit past a limit, and Redis's clock decides the window."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis
from tests.gateway.stack import MODEL, new_state_dir, run
from tests.support.gateways import GatewayProcess, write_gateway_config
from tests.support.http import async_client
from tests.support.waiting import eventually

from saltgate.derivations.derive import ROUTE_CHAT
from saltgate.gateway.admission import Admission
from saltgate.gateway.shared_limits import SharedLimits, SharedTicket
from saltgate.governance.kinds import LimitKind, Scope, Subject
from saltgate.governance.limits import Demand, Limits
from saltgate.policy.errors import ApiError
from saltgate.prices import PriceBook
from saltgate.sim.run import SimConfig, start_sim
from saltgate.store.tenants import Principal, TenantStore
from saltgate_devkit.services import RedisServer

TENANT = Subject(Scope.TENANT, "tn_0000000000000001")
KEY = Subject(Scope.KEY, "key_000000000001")


@asynccontextmanager
async def engines(server: RedisServer, n: int, **kw: float) -> AsyncIterator[list[SharedLimits]]:
    """`n` engines, each on its own connection, as `n` gateways would hold them."""
    password = server.password_file.read_text().strip()
    clients = [Redis.from_url(server.url(), password=password) for _ in range(n)]
    try:
        yield [
            SharedLimits(c, lease_ttl_s=kw.get("ttl", 600.0), window_s=kw.get("window", 60.0))
            for c in clients
        ]
    finally:
        for c in clients:
            await c.aclose()


def test_concurrent_admissions_from_two_gateways_never_pass_the_limit(
    redis_server: RedisServer,
) -> None:
    async def main() -> None:
        async with engines(redis_server, 2) as (a, b):
            limited = [(TENANT, Limits(rpm=50, concurrency=64))]
            results = await asyncio.gather(
                *[(a if i % 2 else b).admit(limited, Demand(10, 10)) for i in range(200)]
            )
            admitted = [r for r in results if r[0] is not None]
            assert len(admitted) == 50
            denial = next(r[1] for r in results if r[1] is not None)
            assert (denial.kind, denial.limit, denial.used) == (LimitKind.REQUESTS, 50, 50)
            assert denial.retry_after_s is not None and 59 < denial.retry_after_s <= 60

            # 64 simultaneous requests at a concurrency cap of 8: exactly 8 leases.
            capped = [(KEY, Limits(concurrency=8))]
            results = await asyncio.gather(
                *[(a if i % 2 else b).admit(capped, Demand(0, 0)) for i in range(64)]
            )
            tickets = [r[0] for r in results if r[0] is not None]
            assert len(tickets) == 8
            assert next(r[1] for r in results if r[1] is not None).kind == LimitKind.CONCURRENCY
            await a.settle(tickets[0], Demand(0, 0))
            assert (await b.admit(capped, Demand(0, 0)))[0] is not None  # one freed, one in
            assert (await b.admit(capped, Demand(0, 0)))[0] is None

    run(main)


def test_no_over_admission_at_a_concurrency_cap_trial_after_trial(
    redis_server: RedisServer,
) -> None:
    """50 trials of 64 simultaneous requests from two connections at a cap of 8: 8 leases
    each time, never 9, and every lease back once settled (the issue asks 100,000 trials
    of the benchmark; this is the test's share of them)."""

    async def main() -> None:
        async with engines(redis_server, 2) as (a, b):
            capped = [(TENANT, Limits(concurrency=8))]
            for trial in range(50):
                results = await asyncio.gather(
                    *[(a if i % 2 else b).admit(capped, Demand(0, 0)) for i in range(64)]
                )
                tickets = [r[0] for r in results if r[0] is not None]
                assert len(tickets) == 8, trial
                await asyncio.gather(*[a.settle(t, Demand(0, 0)) for t in tickets])
            assert await a.client.zcard(f"sg:lim:{TENANT[0]}:{TENANT[1]}:concurrency") == 0

    run(main)


def test_a_budget_is_seeded_from_the_ledger_once_for_the_fleet(
    redis_server: RedisServer,
) -> None:
    """The first gateway to see a budget starts it in Redis from the ledger's spend; a
    second finds it there and adds nothing (the spend counted once, not once per gateway);
    spend older than the period is not counted."""
    subject = Subject(Scope.TENANT, "tn_budgetseed0001")

    async def main() -> None:
        async with engines(redis_server, 2) as (a, b):
            spent = [(4000.0, 1000), (20.0, 5), (10.0, 7)]  # (age s, micro-dollars)
            limits = Limits(budget_micro_usd=12, budget_period_s=3600)
            assert await a.seed_budget(subject, limits, spent) is True
            assert await b.seed_budget(subject, limits, spent) is False
            over = [(subject, limits)]
            _, denial, _ = await a.admit(over, Demand(1, 1, 1))
            assert denial is not None and (denial.kind, denial.used) == ("budget", 12)
            under = [(subject, Limits(budget_micro_usd=13, budget_period_s=3600))]
            assert (await b.admit(under, Demand(1, 1, 1)))[0] is not None

    run(main)


def test_unused_output_returns_and_a_retry_at_retry_after_is_admitted(
    redis_server: RedisServer,
) -> None:
    async def main() -> None:
        async with engines(redis_server, 1, window=1.0) as (engine,):
            limited = [(TENANT, Limits(output_tpm=100))]
            ticket, _, quotas = await engine.admit(limited, Demand(0, 100))
            assert ticket is not None and quotas[0].remaining == 0
            ticket2, denial, _ = await engine.admit(limited, Demand(0, 60))
            assert ticket2 is None and denial is not None and denial.kind == LimitKind.OUTPUT_TOKENS
            await engine.settle(ticket, Demand(0, 30))  # used 30 of the 100 it reserved
            ticket3, _, quotas = await engine.admit(limited, Demand(0, 60))
            assert ticket3 is not None and quotas[0].remaining == 10
            _, denial, _ = await engine.admit(limited, Demand(0, 60))
            assert denial is not None and denial.retry_at is not None
            # Redis's clock decides: wait until it reaches the Retry-After, then retry once.
            client = Redis.from_url(
                redis_server.url(), password=redis_server.password_file.read_text().strip()
            )
            try:
                while True:
                    seconds, micros = await client.time()
                    if seconds + micros / 1e6 >= denial.retry_at:
                        break
                    await asyncio.sleep(0.05)
            finally:
                await client.aclose()
            assert (await engine.admit(limited, Demand(0, 60)))[0] is not None

    run(main)


def test_two_gateway_processes_on_one_redis_hold_the_tenants_limit(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Two `saltgate serve` processes with [cluster]: 40 requests at rpm 10, spread over
    both, admit exactly 10. Redis stopped: each falls back to its explicit share (rpm 5,
    [limits] share = 2), says so in a metric; Redis back: the fleet's limit again."""

    async def main() -> None:
        sim = await start_sim(SimConfig(port=0))
        state = tmp_path / "state"
        key = new_state_dir(state, ("acme",))["acme"]
        with TenantStore.from_state_dir(state) as store:
            store.set_limits("acme", Limits(rpm=10))
        cluster = (
            f'[cluster]\nurl = "{redis_server.url()}"\n'
            f'password_file = "{redis_server.password_file}"\n[limits]\nshare = 2\n'
        )
        gateways = []
        http = async_client(timeout=30, headers={"authorization": f"Bearer {key}"})
        try:
            for i in range(2):
                config = write_gateway_config(
                    tmp_path / f"gw{i}.toml",
                    state_dir=state,
                    replicas=[sim.url],
                    sections=cluster.replace("[limits]", f'gateway_id = "gw{i}"\n[limits]'),
                )
                gateways.append(await GatewayProcess.start(config, tmp_path / f"gw{i}.log"))
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}

            async def post(i: int) -> httpx.Response:
                return await http.post(f"{gateways[i % 2].url}/v1/completions", json=body)

            statuses = [r.status_code for r in await asyncio.gather(*map(post, range(40)))]
            assert Counter(statuses) == {200: 10, 429: 30}

            redis_server.stop()
            for i in range(2):
                refused = await post(i)
                assert (
                    refused.status_code == 429
                    or refused.headers["x-ratelimit-limit-requests"] == "5"
                )
                limits = [await post(i) for _ in range(6)]
                assert [r.status_code for r in limits].count(200) <= 5
                assert "Limit 5" in limits[-1].json()["error"]["message"]
                metrics = (
                    await http.get(gateways[i].metrics_url, headers=gateways[i].metrics_headers)
                ).text
                assert "saltgate_limits_shared_up 0.0" in metrics

            redis_server.start()

            async def shared_again() -> bool:
                resp = await post(0)
                return bool(resp.headers.get("x-ratelimit-limit-requests") == "10")

            await eventually(shared_again, what="limits shared through Redis again")
        finally:
            await http.aclose()
            for g in gateways:
                await g.stop()
            await sim.close()

    run(main)


def test_a_gateway_that_loses_redis_counts_what_it_admitted_through_it(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """A gateway with share 2 of rpm 10 admits 3 requests through Redis, then loses it:
    its fallback share of 5 already holds those 3, so 2 more are admitted in the window,
    not a whole share again (which let a loaded fleet reach 2 x L, docs/limits.md)."""

    async def main() -> None:
        sim = await start_sim(SimConfig(port=0))
        state = tmp_path / "state"
        key = new_state_dir(state, ("acme",))["acme"]
        with TenantStore.from_state_dir(state) as store:
            store.set_limits("acme", Limits(rpm=10))
        config = write_gateway_config(
            tmp_path / "gw.toml",
            state_dir=state,
            replicas=[sim.url],
            sections=(
                f'[cluster]\nurl = "{redis_server.url()}"\n'
                f'password_file = "{redis_server.password_file}"\ngateway_id = "gw0"\n'
                "[limits]\nshare = 2\n"
            ),
        )
        gateway = await GatewayProcess.start(config, tmp_path / "gw.log")
        http = async_client(timeout=30, headers={"authorization": f"Bearer {key}"})
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        try:
            for _ in range(3):
                shared = await http.post(f"{gateway.url}/v1/completions", json=body)
                assert shared.status_code == 200
                assert shared.headers["x-ratelimit-limit-requests"] == "10"  # through Redis

            redis_server.stop()
            alone = [await http.post(f"{gateway.url}/v1/completions", json=body) for _ in range(6)]
            assert [r.status_code for r in alone] == [200, 200, 429, 429, 429, 429]
            assert alone[0].headers["x-ratelimit-limit-requests"] == "5"  # the fallback share
            assert "Limit 5, Used 5" in alone[-1].json()["error"]["message"]
            metrics = (await http.get(gateway.metrics_url, headers=gateway.metrics_headers)).text
            assert "saltgate_limits_shared_up 0.0" in metrics
        finally:
            await http.aclose()
            await gateway.stop()
            await sim.close()

    run(main)


def test_a_redis_admission_is_settled_in_the_local_share_too(redis_server: RedisServer) -> None:
    """Admitted through Redis, then Redis lost: the local share holds the request's lease
    and its 400 reserved output tokens until it ends, then what it used (10) and no lease,
    so the fallback admits exactly what is left of the share (490 of 500)."""

    async def main() -> None:
        principal = Principal(
            "tn_1", "acme", "key_1", 0, limits=Limits(output_tpm=1000, concurrency=2)
        )
        async with engines(redis_server, 1) as (engine,):
            admission = Admission(PriceBook(), share=2, shared=engine)
            ticket, _ = await admission.admit(principal, ROUTE_CHAT, MODEL, 40, 400)
            assert isinstance(ticket, SharedTicket) and ticket.local is not None
            redis_server.stop()
            with pytest.raises(ApiError, match="concurrent requests"):  # its one lease
                await admission.admit(principal, ROUTE_CHAT, MODEL, 40, 1)
            admission.settle(ticket, 11, 10, 0)
            with_all_left, _ = await admission.admit(principal, ROUTE_CHAT, MODEL, 40, 490)
            assert not isinstance(with_all_left, SharedTicket)  # the local share admitted it
            admission.settle(with_all_left, 11, 10, 0)
            with pytest.raises(ApiError, match="Limit 500, Used 20"):
                await admission.admit(principal, ROUTE_CHAT, MODEL, 40, 481)

    run(main)
