"""The console under `saltgate serve --workers 2` (the supervisor's admin listener) on a
PostgreSQL store: signed in, fleet from the merged metrics, usage from the rollups."""

from __future__ import annotations

from pathlib import Path

from tests.gateway.stack import run
from tests.support.gateways import GatewayProcess, write_gateway_config
from tests.support.http import async_client

from saltgate.admin.scopes import SCOPES
from saltgate.config import create_master_key
from saltgate.console.security import COOKIE
from saltgate.store.admin_tokens import AdminTokens
from saltgate.store.backends import open_database
from saltgate.store.settings import StoreSettings
from saltgate.store.tenants import TenantStore


def test_the_supervisor_serves_the_console_on_postgresql(
    tmp_path: Path, pg_store: StoreSettings
) -> None:
    master = tmp_path / "master.key"
    create_master_key(master)
    with TenantStore(open_database(pg_store)) as store:
        store.create_tenant("acme")
        token = AdminTokens(store.db).create(SCOPES)[1]
    config = write_gateway_config(
        tmp_path / "gw.toml",
        state_dir=tmp_path / "state",
        master_key_file=master,
        replicas=["http://127.0.0.1:9"],  # never called: no inference request is made
        store=pg_store,
    )

    async def go() -> None:
        gateway = await GatewayProcess.start(config, tmp_path / "gw.log", workers=2)
        try:
            admin = gateway.metrics_url.removesuffix("/metrics")
            async with async_client(base_url=admin, timeout=30) as c:
                r = await c.post(
                    "/console/sign-in", data={"token": token}, headers={"origin": admin}
                )
                assert r.status_code == 303, r.text
                assert COOKIE in c.cookies  # the client sends it from here on
                fleet = (await c.get("/console/fleet.json")).json()
                assert fleet["cluster"]["workers_alive"] == 2
                assert fleet["store"]["backend"] == "postgresql"
                usage = await c.get("/console/usage.json?range=1h")
                assert usage.status_code == 200 and usage.json()["error"] is None
                tenants = (await c.get("/console/tenants.json")).json()
                assert [t["name"] for t in tenants["tenants"]] == ["acme"]
                c.cookies.clear()
                assert (await c.get("/console/tenants.json")).status_code == 401
            async with async_client(base_url=gateway.url, timeout=30) as c:
                assert (await c.get("/console/sign-in")).status_code == 404
        finally:
            await gateway.stop()

    run(go)
