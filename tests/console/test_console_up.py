"""`saltgate up` prints the console's URL beside the admin token; the token signs in there,
and the demo tenants and their traffic are on its pages."""

from __future__ import annotations

import re
from pathlib import Path

from tests.gateway.stack import run
from tests.support.http import async_client
from tests.support.up import saltgate_up

from saltgate.console.security import COOKIE


def test_up_prints_the_console_url_and_its_token_signs_in(tmp_path: Path) -> None:
    async def go() -> None:
        async with saltgate_up(tmp_path / "state") as up:
            found = re.search(r"console:\s+(http://\S+/console/)", up.banner)
            assert found, up.banner
            console = found.group(1)
            assert console == up.admin_url + "/console/"
            body = {"model": "sim-model", "prompt": "Hello", "max_tokens": 2}
            auth = {"authorization": f"Bearer {up.api_key()}"}
            async with async_client(base_url=up.url, timeout=30) as c:
                assert (await c.post("/v1/completions", json=body, headers=auth)).status_code == 200
                assert (await c.get("/console/sign-in")).status_code == 404
            origin = {"origin": up.admin_url}
            async with async_client(base_url=console, timeout=30) as c:
                page = await c.get("overview", follow_redirects=False)
                assert page.status_code == 303  # the control: not signed in yet
                r = await c.post("sign-in", data={"token": up.admin_token()}, headers=origin)
                assert r.status_code == 303 and COOKIE in c.cookies
                tenants = (await c.get("tenants.json")).json()["tenants"]
                assert {t["name"] for t in tenants} == {"demo-alice", "demo-bob"}
                overview = (await c.get("overview.json")).json()
                assert overview["totals"]["num_model_requests"] == 1, overview
                page = await c.get("overview")
                assert page.status_code == 200
                assert '<div class="label">Requests</div><div class="value">1</div>' in page.text

    run(go)
