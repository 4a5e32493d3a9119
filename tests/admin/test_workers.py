"""The admin API under `saltgate serve --workers 2` (the supervisor's admin listener) on
a PostgreSQL store: served beside /metrics, never on the inference port."""

from __future__ import annotations

from pathlib import Path

from tests.gateway.stack import run
from tests.support.gateways import admin_supervisor
from tests.support.http import async_client

from saltgate.store.backends import open_database
from saltgate.store.settings import StoreSettings
from saltgate.store.tenants import TenantStore


def test_the_supervisor_serves_the_admin_api_on_postgresql(
    tmp_path: Path, pg_store: StoreSettings
) -> None:
    async def go() -> None:
        async with admin_supervisor(tmp_path, pg_store) as (gateway, admin, token):
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
