"""The tenants page and one tenant's page (its models, limits and keys)."""

from __future__ import annotations

import time
from typing import Any

from saltgate.console import html
from saltgate.console.common import (
    LIMIT_FIELDS,
    WEIGHT_LABEL,
    Refusal,
    View,
    _budget,
    _cost_result,
    _form_values,
    _int,
    _limits,
)
from saltgate.console.core import ConsoleCore
from saltgate.console.html import esc, fmt, link, raw, url, when
from saltgate.console.security import Session
from saltgate.governance.limits import (
    BUDGET_PERIOD,
    BUDGET_USD,
    limits_label,
)
from saltgate.governance.weight import DEFAULT_WEIGHT, WEIGHT


async def tenants_page(console: ConsoleCore, session: Session, query: dict[str, str]) -> View:
    tenants, error = await console.tenant_list(session)
    start = (int(time.time()) - 30 * 86400) // 86400 * 86400
    params = {
        "start_time": str(start),
        "bucket_width": "1d",
        "limit": "31",
        "group_by": "tenant",
    }
    usage, usage_error = await console.buckets(session, console.service.usage_completions, params)
    costs, _ = await console.buckets(session, console.service.costs, params)
    prompt: dict[str, int] = {}
    cached: dict[str, int | None] = {}
    spend: dict[str, float] = {}
    for b in usage:
        for r in b.get("results") or []:
            t = str(r.get("tenant_id"))
            prompt[t] = prompt.get(t, 0) + _int(r.get("input_tokens"))
            c = r.get("input_cached_tokens")
            cached[t] = (
                None
                if c is None or (t in cached and cached[t] is None)
                else (cached.get(t) or 0) + int(c)
            )
    for b in costs:
        for r in b.get("results") or []:
            t = str(r.get("tenant_id"))
            spend[t] = spend.get(t, 0.0) + _cost_result(r)
    rows = []
    for tenant in tenants:
        tid = str(tenant["id"])
        keys, _ = await console.key_list(session, tid)
        live = sum(1 for k in keys if k.get("revoked_at") is None)
        c = cached.get(tid)
        hit = None if c is None or not prompt.get(tid) else c / prompt[tid]
        limits = tenant.get("limits") or {}
        tenant.update(
            {
                "live_keys": live,
                "spend_30d_usd": spend.get(tid, 0.0),
                "cache_hit_rate_30d": hit,
                "budget_usd": None
                if limits.get("budget_micro_usd") is None
                else limits["budget_micro_usd"] / 1e6,
            }
        )
        rows.append(
            (
                link(url(f"tenants/{tid}"), tenant["name"]),
                esc(tid),
                esc(f"${spend.get(tid, 0.0):.6f}"),
                esc(_budget(limits)),
                esc(limits_label(_limits(limits))),
                esc(f"{tenant.get('weight', DEFAULT_WEIGHT):g}"),
                link(url("keys", {"tenant": tid}), live),
                esc("unknown" if hit is None else f"{hit:.1%}"),
                esc("archived" if tenant.get("archived_at") else "active"),
            )
        )
    data = {"tenants": tenants, "error": error, "usage_error": usage_error}
    body = (
        (html.notice(error, kind="error") if error else "")
        + html.table(
            [
                "Tenant",
                "Id",
                "Spend (30 d)",
                "Budget",
                "Limits",
                "Weight",
                "Live keys",
                "Cache hit rate (30 d)",
                "State",
            ],
            rows,
            empty="No tenants yet.",
        )
        + (
            ""
            if session.tenant_id is not None  # the operator's, as the service says
            else raw("<h2>New tenant</h2>")
            + html.form(
                url("tenants"),
                html.field("name", "Name"),
                "Create tenant",
                name="create-tenant",
            )
        )
    )
    return View("Tenants", data, body)


async def tenant_page(
    console: ConsoleCore, session: Session, tenant_id: str, query: dict[str, str]
) -> View:
    found = await console.do(session, lambda caller: console.service.tenants_get(caller, tenant_id))
    if isinstance(found, Refusal):
        return View(
            "Tenant",
            {"error": found.text},
            html.notice(found.text, kind="error"),
            "tenants",
            found.status,
        )
    tenant: dict[str, Any] = dict(found.to_dict())
    limits = tenant.get("limits") or {}
    weight = f"{tenant.get('weight', DEFAULT_WEIGHT):g}"
    fields = html.EMPTY.join(
        html.field(k, label, shown, kind="text" if k in (BUDGET_USD, BUDGET_PERIOD) else "number")
        for (k, label), shown in zip(LIMIT_FIELDS, _form_values(limits), strict=True)
    ) + html.field(WEIGHT, WEIGHT_LABEL, weight)
    tid = esc(tenant["id"])
    body = (
        html.table(
            ["Name", "Id", "Salt epoch", "Models", "Created", "Limits", "Weight"],
            [
                (
                    esc(tenant["name"]),
                    tid,
                    esc(tenant.get("epoch")),
                    esc(", ".join(tenant.get("models") or []) or "all"),
                    esc(when(tenant.get("created_at"))),
                    esc(limits_label(_limits(limits))),
                    esc(weight),
                )
            ],
        )
        + fmt("<p>{}</p>", link(url("keys", {"tenant": tenant["id"]}), "Keys of this tenant"))
        + raw("<h2>Limits</h2>")
        + (
            raw(
                "<p>The operator sets this tenant's limits, budget and weight (a token "
                "pinned to the tenant may not).</p>"
            )
            if session.tenant_id is not None
            else raw(
                "<p>Leave a field empty for no limit of that kind. The weight is the "
                "tenant's fair share when the replicas are saturated (empty: 1).</p>"
            )
            + html.form(url(f"tenants/{tenant['id']}/limits"), fields, "Save limits", name="limits")
        )
        + raw("<h2>Cache namespace</h2>")
        + html.form(
            url(f"tenants/{tenant['id']}/rotate-salt"),
            "",
            "Rotate the salt",
            name="rotate-salt",
        )
    )
    return View(f"Tenant {tenant['name']}", {"tenant": tenant}, body, "tenants")
