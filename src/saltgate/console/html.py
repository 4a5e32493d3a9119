"""HTML for the console's pages: escaped text, tables, forms and the page frame (pure).

Escaping is the default: text is `str`, markup is `Markup`, and every helper here escapes
any `str` it is given (table cells, form fields, page bodies, what `+` and `join` add to
markup), so a value (a tenant or model name, an audit entry, an error message, a URL
query) reaches a page as text unless code marks it as markup. Markup is written with
`fmt` ("<p>{}</p>", arguments escaped) or `raw` (a literal of this code, no values).
The markup carries no script and no style
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


class Markup(str):
    """HTML made by this module's helpers: passed through as it is, where a `str` is
    escaped. Adding or joining anything to it escapes that first."""

    __slots__ = ()

    def __add__(self, other: object) -> Markup:
        return Markup(str.__add__(self, esc(other)))

    def __radd__(self, other: object) -> Markup:
        return Markup(str.__add__(esc(other), self))

    def join(self, parts: Iterable[object]) -> Markup:
        return Markup(str.join(self, (esc(p) for p in parts)))


EMPTY = Markup("")


def esc(value: object) -> Markup:
    """`value` as HTML text (markup passes as it is)."""
    if isinstance(value, Markup):
        return value
    return Markup(html.escape("" if value is None else str(value), quote=True))


def raw(literal: str) -> Markup:
    """A literal piece of markup written in this code: never a value."""
    return Markup(literal)


def fmt(template: str, *args: object) -> Markup:
    """Markup from a literal `template` with ``{}`` fields, each argument escaped."""
    return Markup(template.format(*(esc(a) for a in args)))


def when(ts: object) -> str:
    """A unix time as UTC text; blank for none."""
    if not isinstance(ts, int | float):
        return ""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def url(path: str, query: Mapping[str, str] | None = None) -> str:
    """A console URL with a query (filters live in the URL)."""
    kept = {k: v for k, v in (query or {}).items() if v}
    return BASE + path + (f"?{urlencode(kept)}" if kept else "")


def link(href: str, text: object) -> Markup:
    return fmt('<a href="{}">{}</a>', href, text)


def table(
    headers: Sequence[str], rows: Iterable[Sequence[object]], *, empty: str = "None"
) -> Markup:
    """A table; a cell is escaped unless it is `Markup`."""
    body = EMPTY.join(
        raw("<tr>") + EMPTY.join(fmt("<td>{}</td>", c) for c in row) + raw("</tr>") for row in rows
    )
    if not body:
        return fmt('<p class="empty">{}</p>', empty)
    head = EMPTY.join(fmt("<th>{}</th>", h) for h in headers)
    return fmt("<table><thead><tr>{}</tr></thead><tbody>{}</tbody></table>", head, body)


def field(name: str, label: str, value: object = "", *, kind: str = "text") -> Markup:
    return fmt('<label>{} <input type="{}" name="{}" value="{}"></label>', label, kind, name, value)


def hidden(name: str, value: object) -> Markup:
    return fmt('<input type="hidden" name="{}" value="{}">', name, value)


def select(name: str, label: str, options: Sequence[tuple[str, str]], chosen: str) -> Markup:
    opts = EMPTY.join(
        fmt('<option value="{}"{}>{}</option>', v, raw(" selected" if v == chosen else ""), t)
        for v, t in options
    )
    return fmt('<label>{} <select name="{}">{}</select></label>', label, name, opts)


def form(
    action: str, fields: object, button: str, *, method: str = "post", name: str = ""
) -> Markup:
    """A form; `fields` is escaped unless `Markup`; `name` (a data-form attribute) is
    what the browser tests find it by."""
    tag = fmt(' data-form="{}"', name) if name else EMPTY
    return fmt(
        '<form method="{}" action="{}"{}>{}<button type="submit">{}</button></form>',
        method,
        action,
        tag,
        fields,
        button,
    )


def tiles(items: Sequence[tuple[str, str]]) -> Markup:
    """KPI tiles: label and value (text)."""
    cells = EMPTY.join(
        fmt('<div class="tile"><div class="label">{}</div><div class="value">{}</div></div>', k, v)
        for k, v in items
    )
    return fmt('<div class="tiles">{}</div>', cells)


def chart(source: str, title: str) -> Markup:
    """A chart static/console.js draws from `source`, a same-origin .json twin's URL."""
    return fmt(
        '<figure class="chart"><figcaption>{}</figcaption>'
        '<div class="plot" data-chart="{}"></div></figure>',
        title,
        source,
    )


def notice(text: str, *, kind: str = "info") -> Markup:
    return fmt('<p class="notice {}" role="status">{}</p>', kind, text)


def page(
    title: str,
    body: object,
    *,
    current: str = "",
    twin: str | None = None,
    signed_in: str | None = None,
) -> bytes:
    """The frame around a page: navigation, sign-out, the link to its .json twin."""
    nav = EMPTY
    if signed_in is not None:
        mark = raw(' aria-current="page"')
        items = EMPTY.join(
            fmt('<a href="{}"{}>{}</a>', BASE + p, mark if p == current else EMPTY, t)
            for p, t in NAV
        )
        nav = fmt(
            '<nav>{}<span class="who">{}</span>{}</nav>',
            items,
            signed_in,
            form(BASE + "sign-out", EMPTY, "Sign out", name="sign-out"),
        )
    json_link = fmt('<p class="twin">{}</p>', link(twin, "This page as JSON")) if twin else EMPTY
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
        f"<main><h1>{esc(title)}</h1>{esc(body)}{json_link}</main></body></html>\n"
    ).encode()
