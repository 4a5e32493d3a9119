"""The usage page (a chart per metric, grouped) and its CSV export."""

from __future__ import annotations

from saltgate.admin.api import CSV, CSV_DISPOSITION
from saltgate.console import html
from saltgate.console.common import (
    GROUPS_ALL,
    METRICS,
    RANGES_LONG,
    TOP_GROUPS,
    Refusal,
    View,
    _chart,
    _choice,
    _cost_result,
    _group_name,
    _max_limit,
    _num,
)
from saltgate.console.core import ConsoleCore
from saltgate.console.html import esc, fmt, link, url
from saltgate.console.security import (
    Session,
    security_headers,
)
from saltgate.http import Response
from saltgate.policy.errors import ApiError


async def usage_page(console: ConsoleCore, session: Session, query: dict[str, str]) -> View:
    chosen, _, width, start = console.range_of(query, RANGES_LONG)
    metric = _choice(query, "metric", dict(METRICS), "input_tokens")
    group = _choice(query, "group_by", dict(GROUPS_ALL), "")
    params = {"start_time": str(start), "bucket_width": width, "limit": _max_limit(width)}
    if group:
        params["group_by"] = group
    service = console.service
    operation = service.costs if metric == "cost_usd" else service.usage_completions
    buckets, error = await console.buckets(session, operation, params)
    times = [int(b["start_time"]) for b in buckets]
    per: dict[str, list[float | None]] = {}
    for i, b in enumerate(buckets):
        for r in b.get("results") or []:
            name = _group_name(r, group)
            values = per.setdefault(name, [0.0] * len(buckets))
            value = _cost_result(r) if metric == "cost_usd" else r.get(metric)
            values[i] = None if value is None or values[i] is None else (values[i] or 0) + value
    totals = {n: (None if None in v else sum(x or 0 for x in v)) for n, v in per.items()}
    ranked = sorted(per, key=lambda n: -(totals[n] or 0))
    shown = [(n, per[n]) for n in ranked[:TOP_GROUPS]]
    if len(ranked) > TOP_GROUPS:
        rest = [per[n] for n in ranked[TOP_GROUPS:]]
        shown.append(("other", [sum(v[i] or 0 for v in rest) for i in range(len(times))]))
    label = dict(METRICS)[metric]
    data = {
        "metric": metric,
        "group_by": group,
        "range": chosen,
        "bucket_width": width,
        "start_time": start,
        "error": error,
        "totals": [{"group": n, "total": totals[n]} for n in ranked],
        "charts": {"usage": _chart(times, shown, label)},
    }
    filters = (
        html.select("metric", "Metric", list(METRICS), metric)
        + html.select("group_by", "Group by", list(GROUPS_ALL), group)
        + html.select("range", "Range", [(r, r) for r in RANGES_LONG], chosen)
        + html.select(
            "bucket_width",
            "Bucket",
            [("1m", "1 minute"), ("1h", "1 hour"), ("1d", "1 day")],
            width,
        )
    )
    twin = url("usage.json", query)
    rows = [(esc(n), esc("unknown" if totals[n] is None else _num(totals[n]))) for n in ranked]
    body = (
        html.form(url("usage"), filters, "Show", method="get", name="usage")
        + (html.notice(error, kind="error") if error else "")
        + html.chart(twin + "#usage", f"{label} per {width}")
        + html.table(["Group", label], rows, empty="No usage in this range.")
        + fmt("<p>{}</p>", link(url("usage.csv", query), "Download as CSV"))
    )
    return View("Usage explorer", data, body)


async def usage_csv(console: ConsoleCore, session: Session, query: dict[str, str]) -> Response:
    """The explorer's range as the admin API's CSV export (usage/completions.csv),
    streamed through: one row per bucket and group, every metric."""
    _, _, width, start = console.range_of(query, RANGES_LONG)
    group = _choice(query, "group_by", dict(GROUPS_ALL), "")
    params = {"start_time": str(start), "bucket_width": width, "limit": _max_limit(width)}
    if group:
        params["group_by"] = str(group)
    caller = await console.caller(session)
    try:  # the query is checked before a byte is streamed
        stream = console.service.usage_completions_csv(caller, params)
    except ApiError as error:
        return console.plain(502, f"Usage: {Refusal(error.status, error.message).text}")
    return Response(200, [CSV, CSV_DISPOSITION, *security_headers()], stream=stream)
