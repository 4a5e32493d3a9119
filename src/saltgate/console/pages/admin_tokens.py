"""The admin tokens page."""

from __future__ import annotations

from saltgate.console import html
from saltgate.console.common import SCOPE_NAMES, View
from saltgate.console.core import ConsoleCore
from saltgate.console.html import esc, fmt, raw, url, when
from saltgate.console.security import Session


async def admin_tokens_page(console: ConsoleCore, session: Session, query: dict[str, str]) -> View:
    found, error = await console.list_all(
        session,
        lambda caller, after: console.service.admin_tokens_list(caller, after=after, limit=100),
        lambda t: t.id,
    )
    tokens = [t.to_dict() for t in found]
    rows = [
        (
            esc(t.get("id")),
            esc(t.get("redacted_value")),
            esc(", ".join(t.get("scopes") or [])),
            esc(t.get("tenant_id") or "every tenant"),
            esc(when(t.get("last_used_at")) or "never"),
            esc("revoked" if t.get("revoked_at") else "live"),
            ""
            if t.get("revoked_at")
            else html.form(
                url(f"admin-tokens/{t['id']}/revoke"),
                "",
                "Revoke",
                name=f"revoke-token-{t['id']}",
            ),
        )
        for t in tokens
    ]
    boxes = html.EMPTY.join(
        fmt('<label><input type="checkbox" name="scopes" value="{}" checked> {}</label>', s, s)
        for s in SCOPE_NAMES
        if s in session.scopes
    )
    body = (
        (html.notice(error, kind="error") if error else "")
        + html.table(
            ["Id", "Token", "Scopes", "Tenant", "Last used", "State", ""],
            rows,
            empty="No admin tokens visible.",
        )
        + raw("<h2>New admin token</h2><p>A token can have only scopes this one has.</p>")
        + html.form(
            url("admin-tokens"),
            fmt('<fieldset class="scopes">{}</fieldset>', boxes)
            + html.field("tenant_id", "Pinned to tenant (id, optional)"),
            "Create admin token",
            name="create-admin-token",
        )
    )
    return View("Admin tokens", {"admin_tokens": tokens, "error": error}, body)
