"""The admin API's usage and costs routes over real traffic: a token pinned to a tenant
reads only that tenant's usage; an unpinned one every tenant's."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from tests.support.console import console_stack
from tests.support.gateways import cli

from saltgate.store.tenants import TenantStore


def tenants_in(answer: httpx.Response) -> set[str]:
    assert answer.status_code == 200, answer.text
    return {r["tenant_id"] for b in answer.json()["data"] for r in b["results"]}


def test_usage_and_costs_by_tenant_and_pinned_to_one(tmp_path: Path) -> None:
    with console_stack(tmp_path) as stack:
        ids = {}
        with TenantStore.from_state_dir(stack.state_dir) as store:
            for name in ("alpha", "beta"):
                ids[name] = store.create_tenant(name).id
                _, key = store.create_key(name)
                deadline = time.monotonic() + 10
                while (status := stack.complete(key).status_code) != 200:
                    assert time.monotonic() < deadline, f"{name}'s key answered {status}"
        pinned = cli(
            "admin-tokens", "create", "--scopes", "usage:read", "--tenant", "alpha",
            "--state-dir", str(stack.state_dir),
        )  # fmt: skip
        start = int(time.time()) // 86400 * 86400 - 86400
        query = {"start_time": str(start), "bucket_width": "1d", "group_by": "tenant"}
        for path in ("usage/completions", "costs"):
            url = f"{stack.origin}/admin/v1/{path}"
            every = httpx.get(
                url, params=query, headers={"authorization": f"Bearer {stack.admin_token}"}
            )
            assert tenants_in(every) == set(ids.values())  # the control: both are there
            mine = httpx.get(url, params=query, headers={"authorization": f"Bearer {pinned}"})
            assert tenants_in(mine) == {ids["alpha"]}
            other = httpx.get(
                url,
                params={**query, "tenant_ids": ids["beta"]},
                headers={"authorization": f"Bearer {pinned}"},
            )
            assert tenants_in(other) == set()
