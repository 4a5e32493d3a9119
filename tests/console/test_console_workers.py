"""The console under `saltgate serve --workers 2` (the supervisor's admin listener) on
a PostgreSQL store: signed in, fleet from the merged metrics, usage from the rollups (a
completion served before, counted there)."""

from __future__ import annotations

from pathlib import Path

from tests.gateway.stack import MODEL, run
from tests.support.gateways import admin_supervisor
from tests.support.http import async_client
from tests.support.sim import sim

from saltgate.console.security import COOKIE
from saltgate.store.settings import StoreSettings


def test_the_supervisor_serves_the_console_on_postgresql(
    tmp_path: Path, pg_store: StoreSettings
) -> None:
    async def go() -> None:
        async with (
            sim() as (replica, _),
            admin_supervisor(tmp_path, pg_store, replica=replica.url) as (
                gateway,
                admin,
                token,
                key,
            ),
        ):
            async with async_client(base_url=gateway.url, timeout=30) as c:
                body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
                served = await c.post(
                    "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}
                )
                assert served.status_code == 200, served.text
            async with async_client(base_url=admin, timeout=30) as c:
                r = await c.post(
                    "/console/sign-in", data={"token": token}, headers={"origin": admin}
                )
                assert r.status_code == 303, r.text
                assert COOKIE in c.cookies  # the client sends it from here on
                fleet = (await c.get("/console/fleet.json")).json()
                assert fleet["cluster"]["workers_alive"] == 2
                assert fleet["store"]["backend"] == "postgresql"
                usage = await c.get("/console/usage.json?range=1h&metric=num_model_requests")
                assert usage.status_code == 200 and usage.json()["error"] is None
                assert usage.json()["totals"] == [{"group": "all", "total": 1}]
                tenants = (await c.get("/console/tenants.json")).json()
                assert [t["name"] for t in tenants["tenants"]] == ["acme"]
                c.cookies.clear()
                assert (await c.get("/console/tenants.json")).status_code == 401
            async with async_client(base_url=gateway.url, timeout=30) as c:
                assert (await c.get("/console/sign-in")).status_code == 404

    run(go)
