"""The admin API under `saltgate serve --workers 2` (the supervisor's admin listener) on
a PostgreSQL store: served beside /metrics, never on the inference port; a price set
through it bills in every worker."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.gateway.stack import MODEL, run
from tests.support.gateways import admin_supervisor
from tests.support.http import async_client
from tests.support.sim import sim
from tests.support.waiting import eventually

from saltgate.prices import Price, PriceVersion
from saltgate.store.backends import open_database
from saltgate.store.settings import StoreSettings
from saltgate.store.tenants import TenantStore

WORKERS = 2  # admin_supervisor's
ROUND = 4  # requests at once: least-connections spreads them over both workers


def test_the_supervisor_serves_the_admin_api_on_postgresql(
    tmp_path: Path, pg_store: StoreSettings
) -> None:
    async def go() -> None:
        async with admin_supervisor(tmp_path, pg_store) as (gateway, admin, token, _):
            auth = {"authorization": f"Bearer {token}"}
            async with async_client(base_url=admin, headers=auth, timeout=30) as c:
                r = await c.post("/admin/v1/tenants", json={"name": "globex"})
                assert r.status_code == 201, r.text
                r = await c.get("/admin/v1/tenants")
                assert {t["name"] for t in r.json()["data"]} == {"acme", "globex"}
                assert (await c.get("/metrics")).status_code == 200
            async with async_client(base_url=gateway.url, headers=auth, timeout=30) as c:
                assert (await c.get("/admin/v1/tenants")).status_code == 404
        with TenantStore(open_database(pg_store)) as store:
            assert store.get_tenant("globex").name == "globex"

    run(go)


def test_every_worker_bills_with_a_price_set_over_the_api(
    tmp_path: Path, pg_store: StoreSettings
) -> None:
    """`--workers 2` on PostgreSQL: each worker's key snapshot hears of the price
    (NOTIFY). Rounds of requests at once, each on a connection of its own, go until one
    round was served by both workers (their request counters say which served how many)
    and billed with the new price throughout: a worker that kept the old price spoils
    every round it serves, so it can never pass."""
    new = PriceVersion.of(MODEL, Price(1.5, 0.15, 6.0))
    prices = f'[prices."{MODEL}"]\ninput = 1.0\ncached_input = 0.1\noutput = 2.0\n'

    async def go() -> None:
        async with (
            sim() as (replica, _),
            admin_supervisor(tmp_path, pg_store, replica=replica.url, sections=prices) as (
                gateway,
                admin,
                token,
                key,
            ),
        ):
            auth = {"authorization": f"Bearer {token}"}
            async with async_client(base_url=admin, headers=auth, timeout=30) as c:
                body = {"input_per_mtok": 1.5, "cached_input_per_mtok": 0.15}
                body["output_per_mtok"] = 6
                r = await c.put(f"/admin/v1/prices/{MODEL}", json=body)
                assert r.status_code == 200 and r.json()["version"] == new.version, r.text
            rounds: list[tuple[list[str], dict[int, float]]] = []

            async def both_workers_bill_anew() -> bool:
                before = await gateway.served_per_worker()
                billed = await asyncio.gather(
                    *(_billed(gateway.url, key, pg_store) for _ in range(ROUND))
                )
                after = await gateway.served_per_worker()
                served = {i: after[i] - before.get(i, 0.0) for i in after}
                # The counters count these requests and nothing else: which worker served
                # each is known exactly, not guessed.
                assert sum(served.values()) == ROUND, served
                rounds.append((billed, served))
                return set(billed) == {new.version} and all(served[i] for i in range(WORKERS))

            try:
                await eventually(
                    both_workers_bill_anew, timeout_s=20, what="a round of both, billed anew"
                )
            except AssertionError as failed:
                last = rounds[-3:]
                raise AssertionError(f"{failed}; {len(rounds)} rounds, the last: {last}") from None

    run(go)


async def _billed(url: str, key: str, store: StoreSettings) -> str:
    """The price version of one completion's record, sent on a connection of its own."""
    async with async_client(base_url=url, timeout=30) as c:
        r = await c.post(
            "/v1/completions",
            headers={"authorization": f"Bearer {key}", "connection": "close"},
            json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
        )
        assert r.status_code == 200, r.text
    db = open_database(store)
    try:
        [(version,)] = db.query(
            "SELECT price_version FROM usage WHERE request_id = ?", (r.headers["x-request-id"],)
        )
    finally:
        db.close()
    return str(version)
