"""The API keys page."""

from __future__ import annotations

from typing import Any

from saltgate.console import html
from saltgate.console.common import View
from saltgate.console.core import ConsoleCore
from saltgate.console.html import esc, raw, url, when
from saltgate.console.security import Session


async def keys_page(console: ConsoleCore, session: Session, query: dict[str, str]) -> View:
    tenants, error = await console.tenant_list(session)
    chosen = query.get("tenant") or (str(tenants[0]["id"]) if tenants else "")
    keys: list[dict[str, Any]] = []
    if chosen and not error:
        keys, error = await console.key_list(session, chosen)
    rows = []
    for k in keys:
        kid = str(k["id"])
        actions = ""
        if k.get("revoked_at") is None:
            actions = html.form(
                url(f"keys/{kid}/rotate"),
                html.field("grace_period_s", "Grace (s)", "86400", kind="number"),
                "Rotate",
                name=f"rotate-{kid}",
            ) + html.form(url(f"keys/{kid}/revoke"), "", "Revoke", name=f"revoke-{kid}")
        rows.append(
            (
                esc(kid),
                esc(k.get("redacted_value")),
                esc(when(k.get("created_at"))),
                esc(when(k.get("last_used_at")) or "never"),
                esc(when(k.get("expires_at")) or "none"),
                esc("revoked " + when(k["revoked_at"]) if k.get("revoked_at") else "live"),
                actions,
            )
        )
    options = [(str(t["id"]), str(t["name"])) for t in tenants]
    data = {"tenant": chosen, "keys": keys, "error": error}
    body = (
        html.form(
            url("keys"),
            html.select("tenant", "Tenant", options, chosen),
            "Show",
            method="get",
            name="pick-tenant",
        )
        + (html.notice(error, kind="error") if error else "")
        + html.table(
            ["Key id", "Key", "Created", "Last used", "Expires", "State", ""],
            rows,
            empty="No keys.",
        )
        + (
            raw("<h2>New key</h2>")
            + html.form(
                url("keys/create"),
                html.hidden("tenant", chosen),
                "Mint a key",
                name="create-key",
            )
            if chosen
            else ""
        )
    )
    return View("Keys", data, body)
