"""The audit log page."""

from __future__ import annotations

from saltgate.console import html
from saltgate.console.common import Refusal, View
from saltgate.console.core import ConsoleCore
from saltgate.console.html import esc, fmt, link, url, when
from saltgate.console.security import Session


async def audit_page(console: ConsoleCore, session: Session, query: dict[str, str]) -> View:
    after = query.get("after", "")
    found = await console.do(
        session,
        lambda caller: console.service.audit_logs_list(
            caller, after_seq=int(after) if after.isdigit() else 0, limit=50
        ),
    )
    error = found.text if isinstance(found, Refusal) else None
    entries = [] if isinstance(found, Refusal) else found.items
    has_more = not isinstance(found, Refusal) and found.has_more
    rows = [
        (
            esc(e.seq),
            esc(when(e.ts)),
            esc(e.actor),
            esc(e.action),
            esc(e.resource_id),
            fmt("<code>{}</code>", e.before or "null"),
            fmt("<code>{}</code>", e.after or "null"),
        )
        for e in entries
    ]
    more = html.EMPTY
    if has_more:
        more = fmt("<p>{}</p>", link(url("audit", {"after": str(entries[-1].seq)}), "Next entries"))
    body = (
        (html.notice(error, kind="error") if error else "")
        + html.table(
            ["#", "Time", "Who", "What", "Resource", "Before", "After"],
            rows,
            empty="No entries.",
        )
        + more
    )
    shown = [e.to_dict() for e in entries]
    return View("Audit log", {"entries": shown, "error": error, "has_more": has_more}, body)
