"""HTML for the console's pages: escaped text, tables, forms and the page frame (pure).

Every value that reaches a page goes through `esc` (tenant names, audit entries and
error messages are data, never markup). The markup carries no script and no style
attribute: the Content-Security-Policy (`default-src 'self'`) allows neither, so the
pages' behaviour is the one vendored script (static/console.js) and their look
static/console.css.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from urllib.parse import urlencode

NAV = (
    ("overview", "Overview"),
    ("usage", "Usage"),
    ("tenants", "Tenants"),
    ("keys", "Keys"),
    ("fleet", "Routing and fleet"),
    ("audit", "Audit log"),
    ("admin-tokens", "Admin tokens"),
    ("prices", "Prices"),
)
BASE = "/console/"


def esc(value: object) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def when(ts: object) -> str:
    """A unix time as UTC text; blank for none."""
    if not isinstance(ts, int | float):
        return ""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def url(path: str, query: Mapping[str, str] | None = None) -> str:
    """A console URL with a query (filters live in the URL)."""
    kept = {k: v for k, v in (query or {}).items() if v}
    return BASE + path + (f"?{urlencode(kept)}" if kept else "")


def link(href: str, text: object) -> str:
    return f'<a href="{esc(href)}">{esc(text)}</a>'


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], *, empty: str = "None") -> str:
    """A table; the cells are markup already (escape values with `esc`)."""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    if not body:
        return f'<p class="empty">{esc(empty)}</p>'
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def field(name: str, label: str, value: object = "", *, kind: str = "text") -> str:
    return (
        f'<label>{esc(label)} <input type="{kind}" name="{esc(name)}" value="{esc(value)}"></label>'
    )


def select(name: str, label: str, options: Sequence[tuple[str, str]], chosen: str) -> str:
    opts = "".join(
        f'<option value="{esc(v)}"{" selected" if v == chosen else ""}>{esc(t)}</option>'
        for v, t in options
    )
    return f'<label>{esc(label)} <select name="{esc(name)}">{opts}</select></label>'


def form(action: str, fields: str, button: str, *, method: str = "post", name: str = "") -> str:
    """A form; `name` (a data-form attribute) is what the browser tests find it by."""
    tag = f' data-form="{esc(name)}"' if name else ""
    return (
        f'<form method="{method}" action="{esc(action)}"{tag}>{fields}'
        f'<button type="submit">{esc(button)}</button></form>'
    )


def tiles(items: Sequence[tuple[str, str]]) -> str:
    """KPI tiles: label and value (text)."""
    cells = "".join(
        f'<div class="tile"><div class="label">{esc(k)}</div><div class="value">{esc(v)}</div>'
        "</div>"
        for k, v in items
    )
    return f'<div class="tiles">{cells}</div>'


def chart(source: str, title: str) -> str:
    """A chart static/console.js draws from `source`, a same-origin .json twin's URL."""
    return (
        f'<figure class="chart"><figcaption>{esc(title)}</figcaption>'
        f'<div class="plot" data-chart="{esc(source)}"></div></figure>'
    )


def notice(text: str, *, kind: str = "info") -> str:
    return f'<p class="notice {esc(kind)}" role="status">{esc(text)}</p>'


def page(
    title: str,
    body: str,
    *,
    current: str = "",
    twin: str | None = None,
    signed_in: str | None = None,
) -> bytes:
    """The frame around a page: navigation, sign-out, the link to its .json twin."""
    nav = ""
    if signed_in is not None:
        mark = ' aria-current="page"'
        items = "".join(
            f'<a href="{BASE}{p}"{mark if p == current else ""}>{esc(t)}</a>' for p, t in NAV
        )
        nav = (
            f"<nav>{items}"
            f'<span class="who">{esc(signed_in)}</span>'
            + form(BASE + "sign-out", "", "Sign out", name="sign-out")
            + "</nav>"
        )
    json_link = f'<p class="twin">{link(twin, "This page as JSON")}</p>' if twin else ""
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)} · saltgate</title>"
        f'<link rel="icon" href="{BASE}static/favicon.svg">'
        f'<link rel="stylesheet" href="{BASE}static/uPlot.min.css">'
        f'<link rel="stylesheet" href="{BASE}static/console.css">'
        f'<script src="{BASE}static/uPlot.iife.min.js" defer></script>'
        f'<script src="{BASE}static/console.js" defer></script>'
        f"</head><body><header><strong>saltgate</strong> console</header>{nav}"
        f"<main><h1>{esc(title)}</h1>{body}{json_link}</main></body></html>\n"
    ).encode()
