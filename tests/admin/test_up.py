"""`saltgate up` mints an admin token beside the demo keys, for its admin listener on
--port + 1, and revokes the previous run's as it does the demo keys."""

from __future__ import annotations

from pathlib import Path

from tests.gateway.stack import run
from tests.support.http import async_client
from tests.support.up import saltgate_up


def test_up_prints_a_working_admin_token_and_revokes_the_last_runs(tmp_path: Path) -> None:
    async def go() -> None:
        state = tmp_path / "state"
        async with saltgate_up(state) as first:
            token = first.admin_token()
            assert token.startswith("sgadm_")
            auth = {"authorization": f"Bearer {token}"}
            async with async_client(base_url=first.admin_url, timeout=30) as c:
                r = await c.get("/admin/v1/tenants", headers=auth)
                assert r.status_code == 200
                assert {t["name"] for t in r.json()["data"]} == {"demo-alice", "demo-bob"}
            async with async_client(base_url=first.url, timeout=30) as c:
                assert (await c.get("/admin/v1/tenants", headers=auth)).status_code == 404
        async with saltgate_up(state) as second:
            assert second.admin_token() != token
            async with async_client(base_url=second.admin_url, timeout=30) as c:
                assert (await c.get("/admin/v1/me", headers=auth)).status_code == 401
                fresh = {"authorization": f"Bearer {second.admin_token()}"}
                assert (await c.get("/admin/v1/me", headers=fresh)).status_code == 200

    run(go)
