"""The usage report (`saltgate usage`): requests, tokens and cost per group, from the ledger.

Cost is what each request was billed when it was recorded (`usage.cost_micro_usd`, integer
micro-dollars, with its price version): a report adds integers, so changing `[prices]`
never re-prices the past, and every grouping of the same rows has the same total. Rows
recorded without a cost (before schema version 4, or for a model that had no price then)
are priced here, per row, at today's prices, and counted in `priced_at_report_requests`;
with no price today either they cost $0 and their model is listed as unpriced.

A request whose replica did not report cached tokens was billed its whole prompt at the
input price: a group with such requests says how many (`unknown_cached_requests`), its
cached tokens are unknown, and its cost is an upper bound. docs/billing.md has it all.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Literal

from saltgate.governance.limits import parse_duration
from saltgate.prices import MICRO, Price, PriceVersion, price_versions
from saltgate.store.db import Database

UsageFormat = Literal["table", "json", "csv"]
GROUP_KEYS = ("tenant", "key", "model", "day")

_DAY_S = 86400


def parse_time(text: str, now: float, option: str = "--since") -> float:
    """`--since`/`--until` value to a unix time: a duration back from `now` ("90m", "24h",
    "7d") or an ISO 8601 date or date-time (without a zone: UTC)."""
    back = parse_duration(text)
    if back is not None:
        return now - back
    try:
        dt = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"{option} {text!r}: expected a duration like 24h, 7d, 30m or an ISO 8601 "
            "date/time like 2025-01-31 or 2025-01-31T12:00:00+00:00 (UTC if no zone)"
        ) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def parse_group_by(text: str) -> tuple[str, ...]:
    """`--group-by` value ("tenant,model") to its keys, in the report's column order."""
    asked = {part.strip() for part in text.split(",") if part.strip()}
    unknown = sorted(asked - set(GROUP_KEYS))
    if unknown or not asked:
        raise ValueError(
            f"--group-by {text!r}: expected one or more of {','.join(GROUP_KEYS)}, "
            "separated by commas"
        )
    return tuple(k for k in GROUP_KEYS if k in asked)


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One group's totals. A key not grouped by is None; so is `tenant_name` for a tenant
    no longer in the tenants table, and `cached_tokens` when a request did not report it."""

    tenant_id: str | None
    tenant_name: str | None
    key_id: str | None
    model: str | None
    day: str | None  # YYYY-MM-DD, UTC
    requests: int
    errors: int  # status >= 400
    prompt_tokens: int
    cached_tokens: int | None
    unknown_cached_requests: int
    unknown_cached_prompt_tokens: int  # billed at the input price: the bound's slack
    completion_tokens: int
    cost_micro_usd: int
    priced_at_report_requests: int  # no cost recorded: priced with today's prices
    unpriced_models: tuple[str, ...]  # no price then nor now: counted as $0


_SUMS = (
    "count(*)",
    "sum(CASE WHEN status >= 400 THEN 1 ELSE 0 END)",
    "sum(prompt_tokens)",
    "sum(cached_tokens)",
    "sum(CASE WHEN cached_tokens IS NULL THEN 1 ELSE 0 END)",
    "sum(CASE WHEN cached_tokens IS NULL THEN prompt_tokens ELSE 0 END)",
    "sum(completion_tokens)",
    "sum(cost_micro_usd)",
    "sum(CASE WHEN cost_micro_usd IS NULL THEN 1 ELSE 0 END)",
)
# Per row, as the gateway prices a request (prices.PriceVersion.cost_micro_usd): uncached
# input floored at 0, unknown cached tokens all at the input price, rounded half up.
_UNCACHED = (
    "CASE WHEN prompt_tokens > COALESCE(cached_tokens, 0) "
    "THEN prompt_tokens - COALESCE(cached_tokens, 0) ELSE 0 END"
)
_DAY = {
    "sqlite": "CAST(ts / 86400 AS INTEGER)",
    "postgresql": "CAST(floor(ts / 86400) AS BIGINT)",
}


def _report_time_cost(prices: Mapping[str, PriceVersion]) -> tuple[str, list[object]]:
    """SQL summing today's cost of the rows without a recorded cost, and its parameters."""
    if not prices:
        return "0", []
    params: list[object] = []

    def price(attr: str) -> str:
        whens = []
        for model, p in prices.items():
            whens.append("WHEN ? THEN CAST(? AS BIGINT)")
            params.extend((model, getattr(p, attr)))
        return f"(CASE model {' '.join(whens)} END)"

    pin, pcached, pout = price("input"), price("cached_input"), price("output")
    cost = (
        f"(({_UNCACHED}) * {pin} + COALESCE(cached_tokens, 0) * {pcached} "
        f"+ completion_tokens * {pout} + {MICRO // 2}) / {MICRO}"
    )
    return f"sum(CASE WHEN cost_micro_usd IS NULL THEN {cost} ELSE 0 END)", params


def usage_report(
    db: Database,
    since: float | None,
    prices: Mapping[str, Price],
    *,
    until: float | None = None,
    group_by: Sequence[str] = ("tenant",),
) -> list[UsageRow]:
    """Totals over [since, until) (unix times; None: unbounded) per group. Grouped by
    tenant alone, every tenant is listed, with usage or not. Sorted by tenant name."""
    keys = tuple(k for k in GROUP_KEYS if k in group_by)
    columns = {"tenant": "tenant_id", "key": "key_id", "model": "model", "day": _DAY[db.backend]}
    grouped_keys = [*(k for k in keys if k != "model"), "model"]
    grouped = [columns[k] for k in grouped_keys]
    versions = price_versions(prices)
    later, later_params = _report_time_cost(versions)
    # Column expressions come from the fixed tables above; values are parameters.
    sql = (
        f"SELECT {', '.join(grouped)}, {', '.join(_SUMS)}, {later} FROM usage "  # noqa: S608
        f"WHERE ts >= ? AND ts < ? GROUP BY {', '.join(grouped)}"
    )
    bounds = (-math.inf if since is None else since, math.inf if until is None else until)
    with db.read_snapshot():  # one snapshot for both queries
        tenants: dict[str, str] = dict(db.query("SELECT id, name FROM tenants"))
        rows = db.query(sql, [*later_params, *bounds])

    # Per group: requests, errors, prompt, cached (reported), unknown-cached requests and
    # their prompt tokens, completion, recorded cost, rows priced now and their cost.
    acc: dict[tuple[str, ...], list[int]] = {}
    unpriced: dict[tuple[str, ...], set[str]] = {}
    if keys == ("tenant",):
        for tid in tenants:
            acc[(tid,)] = [0] * 10
    for row in rows:
        named = dict(zip(grouped_keys, row, strict=False))
        if "day" in named:
            named["day"] = datetime.fromtimestamp(int(named["day"]) * _DAY_S, UTC).date()
        group = tuple(str(named[k]) for k in keys)
        model = str(named["model"])
        sums = [int(v or 0) for v in row[len(grouped_keys) :]]
        if sums[8] and model not in versions:
            unpriced.setdefault(group, set()).add(model)
            sums[8] = 0
        totals = acc.setdefault(group, [0] * 10)
        for i, v in enumerate(sums):
            totals[i] += v

    report = []
    for group, t in acc.items():
        by_key = dict(zip(keys, group, strict=True))
        tenant = by_key.get("tenant")
        report.append(
            UsageRow(
                tenant_id=tenant,
                tenant_name=None if tenant is None else tenants.get(tenant),
                key_id=by_key.get("key"),
                model=by_key.get("model"),
                day=by_key.get("day"),
                requests=t[0],
                errors=t[1],
                prompt_tokens=t[2],
                cached_tokens=None if t[4] else t[3],
                unknown_cached_requests=t[4],
                unknown_cached_prompt_tokens=t[5],
                completion_tokens=t[6],
                cost_micro_usd=t[7] + t[9],
                priced_at_report_requests=t[8],
                unpriced_models=tuple(sorted(unpriced.get(group, ()))),
            )
        )
    report.sort(
        key=lambda u: (
            u.tenant_name is None,
            u.tenant_name or "",
            u.tenant_id or "",
            u.key_id or "",
            u.model or "",
            u.day or "",
        )
    )
    return report


def usd(micro: int) -> str:
    """Micro-dollars as an exact decimal string of dollars ("0.001140")."""
    return f"{micro // MICRO}.{micro % MICRO:06d}"


def _columns(keys: Sequence[str]) -> list[str]:
    head = {
        "tenant": ["tenant", "tenant_id"],
        "key": ["key_id"],
        "model": ["model"],
        "day": ["day"],
    }
    return [c for k in keys for c in head[k]] + [
        "requests",
        "errors",
        "prompt_tokens",
        "cached_tokens",
        "unknown_cached_requests",
        "unknown_cached_prompt_tokens",
        "completion_tokens",
        "cost_usd",
        "priced_at_report_requests",
        "unpriced_models",
    ]


def _as_dict(u: UsageRow, keys: Sequence[str]) -> dict[str, object]:
    d = {f.name: getattr(u, f.name) for f in fields(u)}
    d["tenant"] = u.tenant_name
    d["cost_usd"] = usd(u.cost_micro_usd)  # a string: exact, never a float
    d["unpriced_models"] = list(u.unpriced_models)
    return {c: d[c] for c in _columns(keys)}


def format_usage(
    rows: Sequence[UsageRow], fmt: UsageFormat, group_by: Sequence[str] = ("tenant",)
) -> str:
    """Render a report: an aligned table for people, JSON (array) or CSV for machines.
    Amounts are decimal strings of dollars; unknown cached tokens are null in JSON and
    "unknown" in CSV and the table.

    No trailing newline, so ``print(format_usage(...))`` emits exactly one.
    """
    keys = tuple(k for k in GROUP_KEYS if k in group_by)
    if fmt == "json":
        return json.dumps([_as_dict(u, keys) for u in rows], indent=2)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(_columns(keys))
        for u in rows:
            d = _as_dict(u, keys)
            d["tenant"] = u.tenant_name or ""
            d["cached_tokens"] = "unknown" if u.cached_tokens is None else u.cached_tokens
            d["unpriced_models"] = ";".join(u.unpriced_models)
            w.writerow(["" if v is None else v for v in d.values()])
        return buf.getvalue().removesuffix("\n")
    if fmt == "table":
        return _table(rows, keys)
    raise ValueError(f"unknown usage format {fmt!r}: use table, json or csv")


def _total(rows: Sequence[UsageRow]) -> UsageRow:
    unknown = sum(u.unknown_cached_requests for u in rows)
    return UsageRow(
        "",
        None,
        None,
        None,
        None,
        sum(u.requests for u in rows),
        sum(u.errors for u in rows),
        sum(u.prompt_tokens for u in rows),
        None if unknown else sum(u.cached_tokens or 0 for u in rows),
        unknown,
        sum(u.unknown_cached_prompt_tokens for u in rows),
        sum(u.completion_tokens for u in rows),
        sum(u.cost_micro_usd for u in rows),
        sum(u.priced_at_report_requests for u in rows),
        tuple(sorted({m for u in rows for m in u.unpriced_models})),
    )


def _table(rows: Sequence[UsageRow], keys: Sequence[str]) -> str:
    head = {"tenant": ("TENANT", "ID"), "key": ("KEY",), "model": ("MODEL",), "day": ("DAY",)}
    labels = [c for k in keys for c in head[k]]
    header = (*labels, "REQUESTS", "ERRORS", "PROMPT", "CACHED", "CACHED%", "COMPLETION")
    header += ("COST_USD",)
    total = _total(rows)
    body = [_table_row(u, keys) for u in rows]
    body.append(("TOTAL", *[""] * (len(labels) - 1), *_table_row(total, ())))
    widths = [max(len(r[i]) for r in (header, *body)) for i in range(len(header))]
    lines = [
        "  ".join(
            c.ljust(w) if i < len(labels) else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in (header, *body)
    ]
    if total.unpriced_models:
        lines.append(
            f"* no price configured (counted as $0) for: {', '.join(total.unpriced_models)}"
        )
    if total.unknown_cached_requests:
        lines.append(
            f"^ an upper bound: {total.unknown_cached_requests} requests did not report "
            f"cached tokens; their {total.unknown_cached_prompt_tokens} prompt tokens are "
            "billed at the full input price"
        )
    if total.priced_at_report_requests:
        lines.append(
            f"~ {total.priced_at_report_requests} requests were recorded without a cost "
            "and are priced at today's prices"
        )
    return "\n".join(line.rstrip() for line in lines)


def _table_row(u: UsageRow, keys: Sequence[str]) -> tuple[str, ...]:
    names = {
        "tenant": (u.tenant_name or "(deleted)", u.tenant_id or ""),
        "key": (u.key_id or "",),
        "model": (u.model or "",),
        "day": (u.day or "",),
    }
    cached = "unknown" if u.cached_tokens is None else str(u.cached_tokens)
    pct = (
        f"{100 * u.cached_tokens / u.prompt_tokens:.1f}"
        if u.prompt_tokens and u.cached_tokens is not None
        else "-"
    )
    marks = (
        ("*" if u.unpriced_models else "")
        + ("^" if u.unknown_cached_requests else "")
        + ("~" if u.priced_at_report_requests else "")
    )
    return (
        *[c for k in keys for c in names[k]],
        str(u.requests),
        str(u.errors),
        str(u.prompt_tokens),
        cached,
        pct,
        str(u.completion_tokens),
        usd(u.cost_micro_usd) + marks,
    )
