"""The per-tenant usage report (`saltgate usage`), priced per model (saltgate/prices.py).

Costs are computed from token sums per (tenant, model), which equals summing per-request
costs because cost is linear in tokens. Cached input is billed at its own (usually lower)
price; uncached input = prompt - cached, floored at 0 in case a backend over-reports.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from saltgate.prices import Price
from saltgate.store.db import Database

UsageFormat = Literal["table", "json", "csv"]

_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(text: str, now: float) -> float:
    """`--since` value to a unix time: a duration back from `now` ("90m", "24h", "7d") or
    an ISO 8601 date/time (naive means UTC)."""
    m = _DURATION_RE.fullmatch(text.strip())
    if m:
        return now - float(m.group(1)) * _UNIT_S[m.group(2)]
    try:
        dt = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"--since {text!r}: expected a duration like 24h, 7d, 30m or an ISO 8601 "
            "date/time like 2025-01-31 or 2025-01-31T12:00:00+00:00"
        ) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """One tenant's totals; `unpriced_models` had no price and cost nothing here."""

    tenant_id: str
    tenant_name: str | None  # None: usage rows of a tenant no longer in the tenants table
    requests: int
    errors: int  # status >= 400
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_usd: float
    unpriced_models: tuple[str, ...]


# Portable SQL (SQLite and PostgreSQL): uncached input is floored at 0 per row, as cost()
# does per request.
_USAGE_SQL = (
    "SELECT tenant_id, model, count(*), sum(CASE WHEN status >= 400 THEN 1 ELSE 0 END), "
    "sum(prompt_tokens), sum(cached_tokens), "
    "sum(CASE WHEN prompt_tokens > cached_tokens THEN prompt_tokens - cached_tokens ELSE 0 END), "
    "sum(completion_tokens) FROM usage WHERE ts >= ? GROUP BY tenant_id, model"
)


def usage_report(
    db: Database, since: float | None, prices: Mapping[str, Price]
) -> list[TenantUsage]:
    """Per-tenant totals since `since` (unix time, inclusive; None = all time), every tenant
    listed even without usage, sorted by name."""
    with db.read_snapshot():  # one snapshot for both queries
        tenants: dict[str, str] = dict(db.query("SELECT id, name FROM tenants"))
        rows = db.query(_USAGE_SQL, (-math.inf if since is None else since,))

    acc: dict[str, list[int]] = {tid: [0] * 5 for tid in tenants}
    cost: dict[str, float] = dict.fromkeys(tenants, 0.0)
    unpriced: dict[str, set[str]] = {tid: set() for tid in tenants}
    for tid, model, n, errs, prompt, cached, uncached, completion in rows:
        a = acc.setdefault(tid, [0] * 5)
        for i, v in enumerate((n, errs, prompt, cached, completion)):
            a[i] += int(v)
        price = prices.get(model)
        if price is None:
            unpriced.setdefault(tid, set()).add(model)
            cost.setdefault(tid, 0.0)
        else:
            # The SQL sum floored uncached input per row, as cost() does per request.
            cost[tid] = cost.get(tid, 0.0) + price.cost_split(
                int(uncached), int(cached), int(completion)
            )
    report = [
        TenantUsage(
            tenant_id=tid,
            tenant_name=tenants.get(tid),
            requests=a[0],
            errors=a[1],
            prompt_tokens=a[2],
            cached_tokens=a[3],
            completion_tokens=a[4],
            cost_usd=cost.get(tid, 0.0),
            unpriced_models=tuple(sorted(unpriced.get(tid, ()))),
        )
        for tid, a in acc.items()
    ]
    report.sort(key=lambda u: (u.tenant_name is None, u.tenant_name or "", u.tenant_id))
    return report


_COLUMNS = (
    "tenant",
    "tenant_id",
    "requests",
    "errors",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "cost_usd",
    "unpriced_models",
)


def _as_dict(u: TenantUsage) -> dict[str, object]:
    return {
        "tenant": u.tenant_name,
        "tenant_id": u.tenant_id,
        "requests": u.requests,
        "errors": u.errors,
        "prompt_tokens": u.prompt_tokens,
        "cached_tokens": u.cached_tokens,
        "completion_tokens": u.completion_tokens,
        "cost_usd": round(u.cost_usd, 9),  # drop float noise, keep sub-cent detail
        "unpriced_models": list(u.unpriced_models),
    }


def format_usage(rows: Sequence[TenantUsage], fmt: UsageFormat) -> str:
    """Render a report: an aligned table for people, JSON (array) or CSV for machines.

    No trailing newline, so ``print(format_usage(...))`` emits exactly one.
    """
    if fmt == "json":
        return json.dumps([_as_dict(u) for u in rows], indent=2)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(_COLUMNS)
        for u in rows:
            d = _as_dict(u)
            d["tenant"] = u.tenant_name or ""
            d["cost_usd"] = f"{u.cost_usd:.6f}"
            d["unpriced_models"] = ";".join(u.unpriced_models)
            w.writerow([d[c] for c in _COLUMNS])
        return buf.getvalue().removesuffix("\n")
    if fmt == "table":
        return _table(rows)
    raise ValueError(f"unknown usage format {fmt!r}: use table, json or csv")


def _table(rows: Sequence[TenantUsage]) -> str:
    header = (
        *("TENANT", "ID", "REQUESTS", "ERRORS", "PROMPT", "CACHED", "CACHED%", "COMPLETION"),
        "COST_USD",
    )
    body: list[tuple[str, ...]] = []
    flagged: set[str] = set()
    for u in rows:
        flagged.update(u.unpriced_models)
        body.append(_table_row(u.tenant_name or "(deleted)", u.tenant_id, u, u.unpriced_models))
    total = TenantUsage(
        "",
        None,
        sum(u.requests for u in rows),
        sum(u.errors for u in rows),
        sum(u.prompt_tokens for u in rows),
        sum(u.cached_tokens for u in rows),
        sum(u.completion_tokens for u in rows),
        sum(u.cost_usd for u in rows),
        tuple(sorted(flagged)),
    )
    body.append(_table_row("TOTAL", "", total, total.unpriced_models))
    widths = [max(len(r[i]) for r in (header, *body)) for i in range(len(header))]
    lines = [
        "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in (header, *body)
    ]
    if flagged:
        lines.append(f"* no price configured (counted as $0) for: {', '.join(sorted(flagged))}")
    return "\n".join(line.rstrip() for line in lines)


def _table_row(name: str, tid: str, u: TenantUsage, unpriced: tuple[str, ...]) -> tuple[str, ...]:
    pct = f"{100 * u.cached_tokens / u.prompt_tokens:.1f}" if u.prompt_tokens else "-"
    cost = f"{u.cost_usd:.6f}" + ("*" if unpriced else "")
    return (
        name,
        tid,
        str(u.requests),
        str(u.errors),
        str(u.prompt_tokens),
        str(u.cached_tokens),
        pct,
        str(u.completion_tokens),
        cost,
    )
