"""The console adds no access of its own: a token pinned to a tenant, signed in, sees and
changes only that tenant, and a scope it lacks is refused on the console as on the API."""

from __future__ import annotations

from pathlib import Path

import httpx
from tests.support.console import console_stack
from tests.support.gateways import cli

from saltgate.governance.limits import Limits
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


def test_a_pinned_session_cannot_change_what_the_operator_sets(tmp_path: Path) -> None:
    """The console over the admin service: a pinned session (every scope) is shown no
    limits form and refused the post (the operator's limits stay); once its tenant is
    archived, its session ends (issue 41's findings 2 and 6, as the console meets them)."""
    with console_stack(tmp_path) as stack:
        with TenantStore.from_state_dir(stack.state_dir) as store:
            mine = store.create_tenant("mine").id
            store.set_limits("mine", Limits(rpm=10))
        pinned = cli(
            "admin-tokens", "create", "--scopes", "all", "--tenant", "mine",
            "--state-dir", str(stack.state_dir),
        )  # fmt: skip
        origin = {"origin": stack.origin}
        with httpx.Client(base_url=stack.console_url, timeout=30) as c:
            assert c.post("sign-in", data={"token": pinned}, headers=origin).status_code == 303
            lifted = c.post(f"tenants/{mine}/limits", data={"rpm": "1000"}, headers=origin)
            assert lifted.status_code == 403 and "operator" in lifted.text
            page = c.get(f"tenants/{mine}")
            assert page.status_code == 200 and "rpm=10" in page.text
            assert 'data-form="limits"' not in page.text
            assert 'data-form="create-tenant"' not in c.get("tenants").text
            with TenantStore.from_state_dir(stack.state_dir) as store:
                assert store.get_tenant("mine").limits == Limits(rpm=10)
                store.archive_tenant("mine")
            ended = c.get("tenants.json")  # the session ends: sign in again
            assert ended.status_code == 303 and ended.headers["location"].endswith("sign-in")
            assert c.get("tenants.json").status_code == 401
            again = c.post("sign-in", data={"token": pinned}, headers=origin)
            assert again.status_code == 401
