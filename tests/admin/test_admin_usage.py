"""The admin API's usage and costs routes over real traffic: a token pinned to a tenant
reads only that tenant's usage; an unpinned one every tenant's. The CSV export holds the
JSON's rows; reconcile finds a rollup edited behind the ledger's back."""

from __future__ import annotations

import csv
import io
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
from tests.support.console import ConsoleStack, console_stack
from tests.support.gateways import cli
from tests.support.waiting import eventually_blocking

from saltgate.store.tenants import TenantStore, db_path


def tenants_in(answer: httpx.Response) -> set[str]:
    assert answer.status_code == 200, answer.text
    return {r["tenant_id"] for b in answer.json()["data"] for r in b["results"]}


def test_usage_and_costs_by_tenant_and_pinned_to_one(tmp_path: Path) -> None:
    with console_stack(tmp_path) as stack:
        ids, pinned = two_tenants_with_traffic(stack)
        query = {**DAILY, "group_by": "tenant"}
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


def two_tenants_with_traffic(stack: ConsoleStack) -> tuple[dict[str, str], str]:
    """Tenants alpha and beta, a completion each, in the rollups; and an admin token with
    usage:read pinned to alpha."""
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
    eventually_blocking(
        lambda: (
            tenants_in(get(stack, stack.admin_token, "usage/completions", DAILY))
            == set(ids.values())
        ),
        what="both tenants' completions in the rollups",
    )
    return ids, pinned


DAILY = {
    "start_time": str(int(time.time()) // 86400 * 86400 - 86400),
    "bucket_width": "1d",
    "group_by": "tenant,model",
}


def get(stack: ConsoleStack, token: str, path: str, query: dict[str, str]) -> httpx.Response:
    return httpx.get(
        f"{stack.origin}/admin/v1/{path}",
        params=query,
        headers={"authorization": f"Bearer {token}"},
        timeout=30,
    )


def csv_rows(answer: httpx.Response) -> list[dict[str, str]]:
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/csv")
    assert answer.headers["transfer-encoding"] == "chunked"  # streamed, not built whole
    return list(csv.DictReader(io.StringIO(answer.text)))


# The CSV columns that are the JSON's fields, as they are.
SAME_COLUMNS = (
    "tenant_id", "api_key_id", "model", "replica", "num_model_requests", "num_errors",
    "input_tokens", "output_tokens", "input_cached_tokens_unknown_requests",
)  # fmt: skip


def json_rows(answer: httpx.Response) -> list[dict[str, Any]]:
    """The JSON's results as the CSV spells them (its columns, as text)."""
    assert answer.status_code == 200, answer.text
    rows = []
    for b in answer.json()["data"]:
        for r in b["results"]:
            cached = r["input_cached_tokens"]
            rows.append(
                {
                    "start_time": str(b["start_time"]),
                    "end_time": str(b["end_time"]),
                    "input_cached_tokens": "unknown" if cached is None else str(cached),
                    **{k: "" if r[k] is None else str(r[k]) for k in SAME_COLUMNS},
                }
            )
    return rows


def test_csv_export_holds_the_json_rows_and_refuses_bad_parameters_first(
    tmp_path: Path,
) -> None:
    with console_stack(tmp_path) as stack:
        ids, pinned = two_tenants_with_traffic(stack)
        root = stack.admin_token
        exported = csv_rows(get(stack, root, "usage/completions.csv", DAILY))
        shown = json_rows(get(stack, root, "usage/completions", DAILY))
        assert len(exported) == len(shown) >= 2
        assert [{k: r[k] for k in shown[0]} for r in exported] == shown
        assert {r["tenant_id"] for r in exported} == set(ids.values())  # the control

        # A pinned token's export: its tenant's rows only, whatever it asks for.
        assert {
            r["tenant_id"] for r in csv_rows(get(stack, pinned, "usage/completions.csv", DAILY))
        } == {ids["alpha"]}
        other = get(stack, pinned, "usage/completions.csv", {**DAILY, "tenant_ids": ids["beta"]})
        assert csv_rows(other) == []

        # A bad parameter: a 400 in OpenAI's shape, no CSV byte sent before it.
        for bad, param in (
            ({"bucket_width": "1w"}, "bucket_width"),
            ({"start_time": "x"}, "start_time"),
        ):
            r = get(stack, root, "usage/completions.csv", {**DAILY, **bad})
            assert r.status_code == 400 and r.headers["content-type"] == "application/json"
            assert r.json()["error"]["param"] == param and r.json()["error"]["message"]
            assert "transfer-encoding" not in r.headers


def test_reconcile_is_ok_until_a_rollup_row_is_edited(tmp_path: Path) -> None:
    with console_stack(tmp_path) as stack:
        ids, pinned = two_tenants_with_traffic(stack)
        root = stack.admin_token
        r = get(stack, root, "usage/reconcile", {})
        assert r.status_code == 200, r.text
        fresh = r.json()
        assert fresh["ok"] is True and fresh["mismatches"] == []
        assert fresh["ledger"]["requests"] == 2
        mine = get(stack, pinned, "usage/reconcile", {}).json()
        assert mine["ok"] is True and mine["ledger"]["requests"] == 1  # alpha's only

        # Positive control: one token added to beta's hourly rollup, not to the ledger.
        with sqlite3.connect(db_path(stack.state_dir)) as db:
            changed = db.execute(
                "UPDATE usage_rollup_1h SET output_tokens = output_tokens + 1 WHERE tenant_id = ?",
                (ids["beta"],),
            ).rowcount
        assert changed == 1
        edited = get(stack, root, "usage/reconcile", {}).json()
        assert edited["ok"] is False
        assert edited["mismatches"] == [
            {"table": "usage_rollup_1h", "rows_only_in_ledger": 1, "rows_only_in_rollup": 1}
        ]
        # Pinned to alpha, whose rows were not edited: still ok.
        assert get(stack, pinned, "usage/reconcile", {}).json()["ok"] is True
