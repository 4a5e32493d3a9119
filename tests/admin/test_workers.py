"""The admin API under `saltgate serve --workers 2` (the supervisor's admin listener) on
a PostgreSQL store: served beside /metrics, never on the inference port."""

from __future__ import annotations

from pathlib import Path

from tests.gateway.stack import run
from tests.support.gateways import GatewayProcess, write_gateway_config
from tests.support.http import async_client

from saltgate.admin.scopes import SCOPES
from saltgate.config import create_master_key
from saltgate.store.admin_tokens import AdminTokens
from saltgate.store.backends import open_database
from saltgate.store.settings import StoreSettings
from saltgate.store.tenants import TenantStore


def test_the_supervisor_serves_the_admin_api_on_postgresql(
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
            auth = {"authorization": f"Bearer {token}"}
            async with async_client(base_url=admin, headers=auth, timeout=30) as c:
                r = await c.post("/admin/v1/tenants", json={"name": "globex"})
                assert r.status_code == 201, r.text
                r = await c.get("/admin/v1/tenants")
                assert {t["name"] for t in r.json()["data"]} == {"acme", "globex"}
                assert (await c.get("/metrics")).status_code == 200
            async with async_client(base_url=gateway.url, headers=auth, timeout=30) as c:
                assert (await c.get("/admin/v1/tenants")).status_code == 404
        finally:
            await gateway.stop()
        with TenantStore(open_database(pg_store)) as store:
            assert store.get_tenant("globex").name == "globex"

    run(go)
