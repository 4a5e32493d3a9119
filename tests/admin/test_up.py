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


def test_up_serves_through_the_fair_queue(tmp_path: Path) -> None:
    """Fair by default: the gateway `saltgate up` starts runs the saturation gate and the
    fair queue (issue 42: a newcomer's gateway let a noisy tenant take the replicas); a
    request that found a place is counted as having waited 0 s, by tenant."""

    async def go() -> None:
        async with saltgate_up(tmp_path / "state") as up:
            async with async_client(base_url=up.url, timeout=30) as c:
                r = await c.post(
                    "/v1/completions",
                    headers={"authorization": f"Bearer {up.api_key()}"},
                    json={"model": "sim-model", "prompt": "Hello", "max_tokens": 4},
                )
                assert r.status_code == 200, r.text
            auth = {"authorization": f"Bearer {up.admin_token()}"}
            async with async_client(base_url=up.admin_url, timeout=30) as c:
                scrape = (await c.get("/metrics", headers=auth)).text
            assert "saltgate_queue_wait_seconds_count{tenant=" in scrape, scrape[:500]

    run(go)
