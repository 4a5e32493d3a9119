"""The overview page: traffic, tokens, cost and time to first token at a glance."""

from __future__ import annotations

import time
from typing import Any

from saltgate.admin import scopes
from saltgate.console import html
from saltgate.console.common import (
    METRICS,
    RANGES_LONG,
    View,
    _chart,
    _cost,
    _max_limit,
    _num,
    _quantile,
    _sum,
    _total,
    _ttft_text,
)
from saltgate.console.core import ConsoleCore
from saltgate.console.html import url
from saltgate.console.security import Session


async def overview_page(console: ConsoleCore, session: Session, query: dict[str, str]) -> View:
    chosen, _, width, start = console.range_of(query, RANGES_LONG)
    params = {"start_time": str(start), "bucket_width": width, "limit": _max_limit(width)}
    usage, usage_error = await console.buckets(session, console.service.usage_completions, params)
    costs, cost_error = await console.buckets(session, console.service.costs, params)
    times = [int(b["start_time"]) for b in usage]
    series: dict[str, list[float | None]] = {
        k: [_sum(b, k) for b in usage] for k, _ in METRICS if k != "cost_usd"
    }
    cost_by_time = {int(b["start_time"]): _cost(b) for b in costs}
    series["cost_usd"] = [cost_by_time.get(t, 0.0) for t in times]
    totals = {k: _total(v) for k, v in series.items()}
    if usage_error:  # unknown, not 0
        totals = dict.fromkeys(totals)
    prompt, cached = totals.get("input_tokens") or 0, totals.get("input_cached_tokens")
    hit = None if cached is None or not prompt else cached / prompt
    ttft = await ttft_view(console, session)
    data = {
        "range": chosen,
        "bucket_width": width,
        "start_time": start,
        "totals": {**totals, "cache_hit_rate": hit},
        "usage_error": usage_error,
        "cost_error": cost_error,
        "ttft": ttft,
        "charts": {
            "tokens": _chart(times, [(label, series[k]) for k, label in METRICS[1:4]], "tokens"),
            "requests": _chart(
                times, [(label, series[k]) for k, label in (METRICS[0], METRICS[4])], "requests"
            ),
            "cost": _chart(times, [("Cost (USD)", series["cost_usd"])], "USD"),
            "ttft": _chart(
                ttft["series"]["time"], [("Mean TTFT (s)", ttft["series"]["mean_s"])], "s"
            ),
        },
    }
    tiles = [
        ("Requests", _num(totals.get("num_model_requests"))),
        ("Prompt tokens", _num(totals.get("input_tokens"))),
        ("Cached tokens", _num(cached)),
        ("Completion tokens", _num(totals.get("output_tokens"))),
        ("Cache hit rate", "unknown" if hit is None else f"{hit:.1%}"),
        ("Cost", "unknown" if cost_error else f"${totals.get('cost_usd') or 0:.6f}"),
        ("Errors", _num(totals.get("num_errors"))),
        ("TTFT p50 / p95 (streamed)", _ttft_text(ttft)),
    ]
    twin = url("overview.json", query)
    body = (
        html.form(
            url("overview"),
            html.select("range", "Range", [(r, r) for r in RANGES_LONG], chosen),
            "Show",
            method="get",
            name="range",
        )
        + (html.notice(f"Usage: {usage_error}", kind="error") if usage_error else "")
        + html.tiles(tiles)
        + html.chart(twin + "#tokens", "Tokens")
        + html.chart(twin + "#requests", "Requests and errors")
        + html.chart(twin + "#cost", "Cost (USD)")
        + html.chart(twin + "#ttft", "Time to first token, mean between samples (this gateway)")
    )
    return View("Overview", data, body)


async def ttft_view(console: ConsoleCore, session: Session) -> dict[str, Any]:
    """TTFT quantiles since start, and the mean between samples the console took:
    every tenant's traffic, so nothing for a token that may not read it."""
    if scopes.may_read_fleet(session.scopes, session.tenant_id) is not None:
        return {
            "requests": None,
            "mean_s": None,
            "p50_s": None,
            "p95_s": None,
            "series": {"time": [], "mean_s": []},
        }
    snap = await console.snapshot()
    hist = snap.histograms.get("saltgate_time_to_first_token_seconds")
    count = total = 0.0
    if hist is not None:
        for values, summed in hist.values.values():
            count += sum(values)
            total += summed
    samples = console.ttft.samples
    if not samples or count != samples[-1][1]:  # a point per read that saw new requests
        samples.append((time.time(), count, total))
    times, means = [], []
    for (_, c0, s0), (t1, c1, s1) in zip(samples, list(samples)[1:], strict=False):
        if c1 > c0:
            times.append(int(t1))
            means.append((s1 - s0) / (c1 - c0))
    return {
        "requests": int(count),
        "mean_s": total / count if count else None,
        "p50_s": None if hist is None else _quantile(hist, 0.5),
        "p95_s": None if hist is None else _quantile(hist, 0.95),
        "series": {"time": times, "mean_s": means},
    }
