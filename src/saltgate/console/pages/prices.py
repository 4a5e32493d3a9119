"""The prices page."""

from __future__ import annotations

from saltgate.console import html
from saltgate.console.common import Refusal, View
from saltgate.console.core import ConsoleCore
from saltgate.console.html import esc, raw, url
from saltgate.console.security import Session


async def prices_page(console: ConsoleCore, session: Session, query: dict[str, str]) -> View:
    """The prices in effect (the store's over the config's), and with prices:write a
    form to set a model's and a button to clear each set in the store."""
    found = await console.do(session, console.service.prices_list)
    error = found.text if isinstance(found, Refusal) else None
    prices = [] if isinstance(found, Refusal) else [dict(p.to_dict()) for p in found]
    writes = "prices:write" in session.scopes and session.tenant_id is None
    rows = [
        (
            esc(p.get("model")),
            esc(f"${p.get('input_per_mtok')}"),
            esc(f"${p.get('cached_input_per_mtok')}"),
            esc(f"${p.get('output_per_mtok')}"),
            esc(p.get("version")),
            esc(p.get("source")),
            html.form(
                url("prices/clear"),
                html.hidden("model", p.get("model")),
                "Clear",
                name=f"clear-price-{p.get('model')}",
            )
            if writes and p.get("source") == "store"
            else "",
        )
        for p in prices
    ]
    body = (html.notice(error, kind="error") if error else "") + html.table(
        [
            "Model",
            "Input / Mtok",
            "Cached input / Mtok",
            "Output / Mtok",
            "Version",
            "Source",
            "",
        ],
        rows,
        empty="No prices: usage is counted, not priced.",
    )
    body += raw(
        "<p>A price set here (source <em>store</em>) overrides the configuration's "
        "<code>[prices]</code> table for that model; clearing it reverts to the "
        "configuration's. The gateways bill with a change within a second; a request "
        "keeps the price of its time.</p>"
    )
    if writes:
        body += raw(
            "<h2>Set a price</h2><p>USD per million tokens, up to 6 decimals.</p>"
        ) + html.form(
            url("prices"),
            html.field("model", "Model")
            + html.field("input_per_mtok", "Input")
            + html.field("cached_input_per_mtok", "Cached input")
            + html.field("output_per_mtok", "Output"),
            "Set price",
            name="set-price",
        )
    return View("Prices", {"prices": prices, "error": error}, body)
