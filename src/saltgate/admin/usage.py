"""Usage and costs in the shape of OpenAI's Usage and Costs APIs, read from the rollups.

Served by the admin API (`/admin/v1/usage/completions`, `/admin/v1/costs`, the CSV
export, `reconcile`) and, for a tenant's own usage, by `GET /v1/usage` on the inference
port. Each function takes the query string's parameters and the tenant the caller is
pinned to (None: every tenant), and answers (status, JSON document): a bad parameter is a
400 in OpenAI's error shape, never a 500. docs/usage-api.md is the reference.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any

from saltgate.policy.errors import ApiError, invalid_request
from saltgate.store import usage_rollups
from saltgate.store.pricing import usd
from saltgate.store.schema import ROLLUP_DIMS
from saltgate.store.usage_rollups import Group, Top, UsageReader, rank_groups, read_buckets

WIDTHS = {"1m": 60, "1h": 3600, "1d": 86400}
# The most buckets one CSV export holds: a leap year of hours (and of days; six days of
# minutes). The export reads them all, a page at a time, while the client waits.
MAX_CSV_BUCKETS = 366 * 24
# OpenAI's default and largest `limit` (buckets per page) per width; its Costs API allows
# up to 180 daily buckets.
USAGE_LIMITS = {"1m": (60, 1440), "1h": (24, 168), "1d": (7, 31)}
COSTS_LIMITS = {"1m": (60, 1440), "1h": (24, 168), "1d": (7, 180)}
# group_by names (the issue's, and OpenAI's field names) -> the rollups' dimensions.
GROUP_NAMES = {
    "tenant": "tenant_id",
    "tenant_id": "tenant_id",
    "key": "key_id",
    "api_key_id": "key_id",
    "model": "model",
    "replica": "replica",
}
# Filter parameters (comma-separated lists) -> dimensions.
FILTERS = {
    "tenant_ids": "tenant_id",
    "api_key_ids": "key_id",
    "models": "model",
    "replicas": "replica",
}
# The result field each dimension is named by.
FIELDS = {"tenant_id": "tenant_id", "key_id": "api_key_id", "model": "model", "replica": "replica"}
_CURSOR_PREFIX = "page_"
MAX_TOP = 1000
# The longest cursor that carries `top`'s ranking (a URL of a few kB is as long as some
# proxies and browsers take); a longer ranking (up to MAX_TOP groups of long names) is left
# out, and the next page ranks again.
MAX_CURSOR = 2000
# What `top` ranks groups by: all their tokens (usage), their cost (costs).
USAGE_RANK = ("input_tokens", "output_tokens")
COST_RANK = ("cost_micro_usd",)


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """A checked query: buckets [start, end) of `width` seconds; this page starts at `page`.
    `ranking`: the groups `top` keeps, as the cursor carried them (None: not ranked yet)."""

    width_name: str
    width: int
    start: int
    end: int
    page: int
    limit: int
    group_by: tuple[str, ...]
    filters: Mapping[str, tuple[str, ...]]
    top: int | None = None
    ranking: tuple[tuple[str, ...], ...] | None = None

    @property
    def page_end(self) -> int:
        return min(self.end, self.page + self.limit * self.width)


def _int_param(query: Mapping[str, str], name: str) -> int | None:
    raw = query.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise invalid_request(f"'{name}' must be an integer.", param=name) from None


def _range(query: Mapping[str, str], width_name: str, now: float | None) -> tuple[int, int]:
    """[start, end) on bucket boundaries: from the bucket holding `start_time` (OpenAI
    documents it as inclusive, and clients pass "now minus 7 days", not a boundary)
    through the bucket holding the last second before `end_time` (exclusive); end defaults
    to the end of the running bucket."""
    width = WIDTHS[width_name]
    start = _int_param(query, "start_time")
    if start is None:
        raise invalid_request("'start_time' is required (Unix seconds).", param="start_time")
    end = _int_param(query, "end_time")
    if end is None:
        end = _running_end(width, now)
    for name, value in (("start_time", start), ("end_time", end)):
        if value < 0:
            raise invalid_request(f"'{name}' must be Unix seconds, not negative.", param=name)
    if end <= start:
        raise invalid_request("'end_time' must be after 'start_time'.", param="end_time")
    return start - start % width, end + (-end % width)


def _running_end(width: int, now: float | None) -> int:
    """The end of the bucket running now: nothing is recorded past it."""
    moment = int(time.time() if now is None else now)
    return moment - moment % width + width


def _group_by(query: Mapping[str, str]) -> tuple[str, ...]:
    group_by: list[str] = []
    for name in filter(None, (query.get("group_by") or "").split(",")):
        dim = GROUP_NAMES.get(name.strip())
        if dim is None:
            raise invalid_request(
                "'group_by' takes any of tenant, key, model, replica (comma-separated).",
                param="group_by",
            )
        if dim not in group_by:
            group_by.append(dim)
    return tuple(group_by)


def _filters(query: Mapping[str, str], tenant_id: str | None) -> dict[str, tuple[str, ...]]:
    """The filters asked for; a caller pinned to a tenant is kept to it, whatever
    `tenant_ids` says (asking for another tenant narrows to nothing)."""
    filters: dict[str, tuple[str, ...]] = {}
    for name, dim in FILTERS.items():
        raw = query.get(name)
        if raw:
            filters[dim] = tuple(v.strip() for v in raw.split(",") if v.strip())
    if tenant_id is not None:
        asked = filters.get("tenant_id")
        filters["tenant_id"] = (tenant_id,) if asked is None or tenant_id in asked else ()
    return filters


def parse_query(
    query: Mapping[str, str],
    tenant_id: str | None,
    limits: Mapping[str, tuple[int, int]] = USAGE_LIMITS,
    now: float | None = None,
) -> UsageQuery:
    """Check every parameter (ApiError 400 naming the first wrong one)."""
    width_name = query.get("bucket_width") or "1d"
    if width_name not in WIDTHS:
        raise invalid_request("'bucket_width' must be one of 1m, 1h, 1d.", param="bucket_width")
    width = WIDTHS[width_name]
    start, end = _range(query, width_name, now)
    default, most = limits[width_name]
    limit = _int_param(query, "limit")
    if limit is None:
        limit = default
    elif not 1 <= limit <= most:
        raise invalid_request(
            f"'limit' must be between 1 and {most} for bucket_width {width_name}.", param="limit"
        )
    group_by = _group_by(query)
    top = _int_param(query, "top")
    if top is not None and not (group_by and 1 <= top <= MAX_TOP):
        raise invalid_request(
            f"'top' takes 1 to {MAX_TOP} groups, and needs a group_by.", param="top"
        )
    page, ranking = start, None
    cursor = query.get("page")
    if cursor:
        page, ranking = _decode_cursor(cursor, top, len(group_by))
        if not (start <= page < end and (page - start) % width == 0):
            raise _not_a_cursor()
    return UsageQuery(
        width_name,
        width,
        start,
        end,
        page,
        limit,
        group_by,
        _filters(query, tenant_id),
        top,
        ranking,
    )


def _not_a_cursor() -> ApiError:
    return invalid_request("'page' is not a cursor of this query.", param="page")


def _encode_cursor(page: int, ranking: tuple[tuple[str, ...], ...] | None) -> str:
    """Opaque: base64url of the next page's start, or of {"p": start, "r": ranking} with
    the groups `top` ranked on the first page, so that every page lists those (and ranks
    no more), even while usage arrives. A ranking that would make the cursor longer than
    MAX_CURSOR is left out: the next page ranks again (and may then list other groups)."""

    def encode(value: object) -> str:
        text = json.dumps(value, separators=(",", ":"))
        return _CURSOR_PREFIX + base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")

    if ranking is not None:
        cursor = encode({"p": page, "r": ranking})
        if len(cursor) <= MAX_CURSOR:
            return cursor
    return encode(page)


def _decode_cursor(
    cursor: str, top: int | None, arity: int
) -> tuple[int, tuple[tuple[str, ...], ...] | None]:
    """The page start and ranking of a cursor (a bare start: one handed out before cursors
    carried rankings, or one without). A ranking is checked strictly: it only narrows what
    the filters (the tenant pin among them) let through, but must fit this query: at most
    `top` groups of `arity` strings each."""
    try:
        if not cursor.startswith(_CURSOR_PREFIX):
            raise ValueError
        raw = cursor[len(_CURSOR_PREFIX) :]
        value = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
    except (ValueError, binascii.Error, UnicodeDecodeError, RecursionError):
        raise _not_a_cursor() from None
    ranking = None
    if isinstance(value, dict) and value.keys() == {"p", "r"}:
        value, ranking = value["p"], _ranking(value["r"], top, arity)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _not_a_cursor()
    return value, ranking


def _ranking(value: object, top: int | None, arity: int) -> tuple[tuple[str, ...], ...]:
    if not (
        top is not None
        and isinstance(value, list)
        and len(value) <= top
        and all(
            isinstance(group, list)
            and len(group) == arity
            and all(isinstance(v, str) for v in group)
            for group in value
        )
    ):
        raise _not_a_cursor()
    return tuple(tuple(group) for group in value)


async def _top_groups(
    reader: UsageReader, q: UsageQuery, rank: tuple[str, ...]
) -> tuple[tuple[str, ...], ...] | None:
    """The groups `top` keeps (None: every group): the cursor's, or ranked now over the
    whole range, not only this page (on the first page, or after a cursor without them)."""
    if q.top is None or q.ranking is not None:
        return q.ranking
    return await rank_groups(
        reader,
        q.width,
        group_by=q.group_by,
        filters=q.filters,
        top=Top(q.top, rank, q.start, q.end),
    )


def _dims(group: Group, grouped: tuple[str, ...]) -> dict[str, Any]:
    return {FIELDS[d]: group.dims[d] if d in grouped else None for d in ROLLUP_DIMS}


def usage_result(group: Group, grouped: tuple[str, ...]) -> dict[str, Any]:
    """One group's usage. Cached tokens are null when any of its requests did not report
    them (unknown is not 0); the reported part and the unknown requests are given apart."""
    s = group.sums
    unknown = s["cached_unknown_requests"]
    return {
        "object": "organization.usage.completions.result",
        "input_tokens": s["input_tokens"],
        "input_cached_tokens": None if unknown else s["cached_tokens"],
        "input_cached_tokens_reported": s["cached_tokens"],
        "input_cached_tokens_unknown_requests": unknown,
        "input_tokens_cached_unknown": s["cached_unknown_input_tokens"],
        "output_tokens": s["output_tokens"],
        "num_model_requests": s["requests"],
        "num_errors": s["errors"],
        **_dims(group, grouped),
    }


def cost_result(group: Group, grouped: tuple[str, ...]) -> dict[str, Any]:
    """One group's recorded cost: a decimal string over integer micro-dollars."""
    s = group.sums
    return {
        "object": "organization.costs.result",
        "amount": {"value": usd(s["cost_micro_usd"]), "currency": "usd"},
        "amount_micro_usd": s["cost_micro_usd"],
        "line_item": None,
        # An upper bound when cached tokens went unreported (billed at the input price).
        "upper_bound_requests": s["cached_unknown_requests"],
        "unpriced_requests": s["unpriced_requests"],
        **_dims(group, grouped),
    }


async def _page(
    reader: UsageReader,
    query: Mapping[str, str],
    tenant_id: str | None,
    limits: Mapping[str, tuple[int, int]],
    *,
    result: Any,
    rank: tuple[str, ...],
) -> tuple[int, dict[str, Any]]:
    try:
        q = parse_query(query, tenant_id, limits)
    except ApiError as error:
        return error.status, error.to_dict()
    end = q.page_end
    ranking = await _top_groups(reader, q, rank)
    groups = await read_buckets(
        reader, q.width, q.page, end, group_by=q.group_by, filters=q.filters, groups=ranking
    )
    by_bucket: dict[int, list[dict[str, Any]]] = {b: [] for b in range(q.page, end, q.width)}
    for group in groups:
        by_bucket[group.bucket].append(result(group, q.group_by))
    data = [
        {"object": "bucket", "start_time": b, "end_time": b + q.width, "results": results}
        for b, results in by_bucket.items()
    ]
    more = end < q.end
    return 200, {
        "object": "page",
        "data": data,
        "has_more": more,
        "next_page": _encode_cursor(end, ranking) if more else None,
    }


async def usage_completions(
    store: UsageReader, query: Mapping[str, str], tenant_id: str | None
) -> tuple[int, dict[str, Any]]:
    """A page of usage buckets (OpenAI's GET /v1/organization/usage/completions)."""
    return await _page(store, query, tenant_id, USAGE_LIMITS, result=usage_result, rank=USAGE_RANK)


async def costs(
    store: UsageReader, query: Mapping[str, str], tenant_id: str | None
) -> tuple[int, dict[str, Any]]:
    """A page of cost buckets (OpenAI's GET /v1/organization/costs)."""
    return await _page(store, query, tenant_id, COSTS_LIMITS, result=cost_result, rank=COST_RANK)


CSV_COLUMNS = (
    "start_time",
    "end_time",
    "tenant_id",
    "api_key_id",
    "model",
    "replica",
    "num_model_requests",
    "num_errors",
    "input_tokens",
    "input_cached_tokens",
    "input_cached_tokens_unknown_requests",
    "output_tokens",
    "cost_usd",
    "unpriced_requests",
)


def _csv_field(value: object) -> str:
    if value is None:
        return ""
    text = str(value)
    if isinstance(value, str) and text[:1] in ("=", "+", "-", "@"):
        text = "'" + text  # a spreadsheet would run a name (a model's, say) as a formula
    if any(c in text for c in ',"\r\n'):
        return '"' + text.replace('"', '""') + '"'
    return text


def parse_csv_query(
    query: Mapping[str, str], tenant_id: str | None, now: float | None = None
) -> UsageQuery:
    """`parse_query` for an export of the whole range: the range ends at the latest with
    the running bucket (nothing is recorded past it: an end_time years ahead made the
    export read empty pages for as long as the client stayed), and holds at most
    MAX_CSV_BUCKETS buckets (400 beyond: export it in parts)."""
    q = parse_query(query, tenant_id, now=now)
    end = max(q.start, min(q.end, _running_end(q.width, now)))
    if (end - q.start) // q.width > MAX_CSV_BUCKETS:
        raise invalid_request(
            f"an export holds at most {MAX_CSV_BUCKETS} buckets of bucket_width "
            f"{q.width_name}: narrow start_time..end_time, or use a wider bucket_width.",
            param="start_time",
        )
    return dataclasses.replace(q, end=end, page=min(q.page, end))


async def usage_csv(
    store: UsageReader, query: Mapping[str, str], tenant_id: str | None
) -> AsyncGenerator[bytes, None]:
    """Every bucket of the range (not one page) as CSV, streamed a page of buckets at a
    time (`top` ranked once, for all of them); unknown cached tokens are `unknown`. Check
    the query with `parse_csv_query` first: an error here can only end the stream."""
    q = parse_csv_query(query, tenant_id)
    yield (",".join(CSV_COLUMNS) + "\r\n").encode()
    ranking = await _top_groups(store, q, USAGE_RANK)
    page = q.page
    while page < q.end:
        end = min(q.end, page + q.limit * q.width)
        lines = []
        for g in await read_buckets(
            store,
            q.width,
            page,
            end,
            group_by=q.group_by,
            filters=q.filters,
            groups=ranking,
        ):
            u = usage_result(g, q.group_by)
            cached = u["input_cached_tokens"]
            row = (
                g.bucket,
                g.bucket + q.width,
                u["tenant_id"],
                u["api_key_id"],
                u["model"],
                u["replica"],
                u["num_model_requests"],
                u["num_errors"],
                u["input_tokens"],
                "unknown" if cached is None else cached,
                u["input_cached_tokens_unknown_requests"],
                u["output_tokens"],
                usd(g.sums["cost_micro_usd"]),
                g.sums["unpriced_requests"],
            )
            lines.append(",".join(map(_csv_field, row)) + "\r\n")
        if lines:
            yield "".join(lines).encode()
        page = end


async def reconcile(
    store: UsageReader, query: Mapping[str, str], tenant_id: str | None
) -> tuple[int, dict[str, Any]]:
    """Rollups against the ledger, to the token: `ok`, the ledger's totals, and each rollup
    table that disagrees (rows only in one of the two)."""
    del query  # no parameters yet: the whole ledger (of the pinned tenant)
    totals, mismatches = await usage_rollups.reconcile(store, tenant_id)
    return 200, {
        "object": "usage.reconcile",
        "ok": not mismatches,
        "ledger": totals,
        "mismatches": [
            {
                "table": m.table,
                "rows_only_in_ledger": m.rows_only_in_ledger,
                "rows_only_in_rollup": m.rows_only_in_rollup,
            }
            for m in mismatches
        ],
    }
