"""The console adds no access of its own: a token pinned to a tenant, signed in, sees and
changes only that tenant, and a scope it lacks is refused on the console as on the API."""

from __future__ import annotations

from pathlib import Path

import httpx
from tests.support.console import console_stack
from tests.support.gateways import cli

from saltgate.store.tenants import TenantStore


def test_a_pinned_token_sees_only_its_tenant_in_the_console(tmp_path: Path) -> None:
    with console_stack(tmp_path) as stack:
        with TenantStore.from_state_dir(stack.state_dir) as store:
            mine = store.create_tenant("mine").id
            other = store.create_tenant("other").id
        pinned = cli(
            "admin-tokens", "create", "--scopes", "tenants:read,keys:write", "--tenant", "mine",
            "--state-dir", str(stack.state_dir),
        )  # fmt: skip
        origin = {"origin": stack.origin}
        with httpx.Client(base_url=stack.console_url, timeout=30) as every:
            signed_in = every.post("sign-in", data={"token": stack.admin_token}, headers=origin)
            assert signed_in.status_code == 303, signed_in.text
            names = {t["name"] for t in every.get("tenants.json").json()["tenants"]}
            assert names == {"mine", "other"}  # the control: an unpinned token sees both
        with httpx.Client(base_url=stack.console_url, timeout=30) as c:
            assert c.post("sign-in", data={"token": pinned}, headers=origin).status_code == 303
            tenants = c.get("tenants.json").json()["tenants"]
            assert [t["id"] for t in tenants] == [mine]
            assert c.get(f"tenants/{other}.json").status_code == 404
            keys = c.get("keys.json", params={"tenant": other}).json()
            assert keys["keys"] == [] and "no such tenant" in keys["error"]
            minted = c.post("keys/create", data={"tenant": other}, headers=origin)
            assert minted.status_code == 404 and "sg_" not in minted.text
            created = c.post("tenants", data={"name": "sneaky"}, headers=origin)
            assert created.status_code == 403  # no tenants:write, and pinned
            assert c.post("keys/create", data={"tenant": mine}, headers=origin).status_code == 201
        with TenantStore.from_state_dir(stack.state_dir) as store:
            assert {t.name for t in store.list_tenants()} == {"mine", "other"}
            assert [k.tenant_id for k in store.list_keys()] == [mine]
