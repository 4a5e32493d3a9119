"""The usage and costs queries (admin/usage.py) on both backends: OpenAI's shape, buckets
and cursors, `top` ranked once per series, the unknown-cached rule, decimal amounts, the
CSV export, tenant pinning and 400s for bad parameters."""

from __future__ import annotations

import asyncio
import base64
import csv
import io
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from tests.store.test_usage_rollups import T0, record

from saltgate.admin.usage import (
    MAX_CSV_BUCKETS,
    MAX_CURSOR,
    costs,
    parse_csv_query,
    reconcile,
    usage_completions,
    usage_csv,
)
from saltgate.policy.errors import ApiError
from saltgate.store.backends import open_database
from saltgate.store.ledger import USAGE_INSERT, UsageRecord
from saltgate.store.settings import StoreSettings
from saltgate.store.usage_rollups import UsageReader, open_usage_reader

HOUR = 3600
RECORDS = [
    # Hour 0: tenant a, model m, two keys; one request without cached tokens.
    record(1, ts=T0 + 10, key_id="key_1", prompt_tokens=100, cached_tokens=40),
    record(2, ts=T0 + 20, key_id="key_2", prompt_tokens=50, cached_tokens=None),
    # Hour 1: tenant a, model n; cost 1.5 USD.
    record(
        3, ts=T0 + HOUR + 5, model="n", prompt_tokens=10, cached_tokens=0, cost_micro_usd=1_500_000
    ),
    # Hour 2: tenant b.
    record(4, ts=T0 + 2 * HOUR, tenant_id="tn_b", key_id="key_b", prompt_tokens=7, cached_tokens=7),
]


@pytest.fixture
def usage_store(store_settings: StoreSettings) -> StoreSettings:
    db = open_database(store_settings)
    try:
        db.execute_many(USAGE_INSERT, RECORDS)
    finally:
        db.close()
    return store_settings


class Counting:
    """A reader that keeps the statements it ran: what a page costs, in queries."""

    def __init__(self, reader: UsageReader, statements: list[str]) -> None:
        self.reader, self.statements, self.backend = reader, statements, reader.backend

    async def query(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        self.statements.append(sql)
        return await self.reader.query(sql, params)

    async def aclose(self) -> None:
        await self.reader.aclose()


def call(
    settings: StoreSettings,
    fn: Any,
    query: Mapping[str, str],
    tenant: str | None = None,
    statements: list[str] | None = None,
) -> tuple[int, Any]:
    async def go() -> tuple[int, Any]:
        reader = Counting(open_usage_reader(settings), [] if statements is None else statements)
        try:
            return await fn(reader, query, tenant)  # type: ignore[no-any-return]
        finally:
            await reader.aclose()

    return asyncio.run(go())


def add(settings: StoreSettings, records: list[UsageRecord]) -> None:
    db = open_database(settings)
    try:
        db.execute_many(USAGE_INSERT, records)
    finally:
        db.close()


def cursor(value: object) -> str:
    """A cursor as the API encodes one (a forged one, when `value` is not its own)."""
    text = json.dumps(value, separators=(",", ":"))
    return "page_" + base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def listed(page: Mapping[str, Any], field: str) -> list[tuple[int, Any]]:
    return [(b["start_time"], r[field]) for b in page["data"] for r in b["results"]]


def hourly(**extra: str) -> dict[str, str]:
    return {"start_time": str(T0), "end_time": str(T0 + 3 * HOUR), "bucket_width": "1h", **extra}


def test_hourly_buckets_grouped_by_model(usage_store: StoreSettings) -> None:
    status, page = call(usage_store, usage_completions, hourly(group_by="model"), "tn_a")
    assert status == 200
    assert page["object"] == "page" and page["has_more"] is False and page["next_page"] is None
    assert [(b["start_time"], b["end_time"]) for b in page["data"]] == [
        (T0, T0 + HOUR),
        (T0 + HOUR, T0 + 2 * HOUR),
        (T0 + 2 * HOUR, T0 + 3 * HOUR),
    ]
    [first], [second], third = (b["results"] for b in page["data"])
    assert third == []  # tenant b's hour is not tenant a's
    assert first["object"] == "organization.usage.completions.result"
    assert (first["model"], first["input_tokens"], first["num_model_requests"]) == ("m", 150, 2)
    # One request of the bucket did not report cached tokens: unknown, not 40.
    assert first["input_cached_tokens"] is None
    assert first["input_cached_tokens_reported"] == 40
    assert first["input_cached_tokens_unknown_requests"] == 1
    assert first["input_tokens_cached_unknown"] == 50
    assert first["tenant_id"] is None and first["api_key_id"] is None  # not grouped by
    assert (second["model"], second["input_cached_tokens"]) == ("n", 0)


def test_group_by_key_separates_the_unknown(usage_store: StoreSettings) -> None:
    _, page = call(usage_store, usage_completions, hourly(group_by="key,tenant"), None)
    first = {r["api_key_id"]: r for r in page["data"][0]["results"]}
    assert first["key_1"]["input_cached_tokens"] == 40
    assert first["key_2"]["input_cached_tokens"] is None
    assert {r["tenant_id"] for r in first.values()} == {"tn_a"}


def test_pages_cover_the_range_once_and_totals_do_not_depend_on_them(
    usage_store: StoreSettings,
) -> None:
    query = hourly(limit="1")
    seen = []
    while True:
        status, page = call(usage_store, usage_completions, query, None)
        assert status == 200 and len(page["data"]) == 1
        seen += page["data"]
        if not page["has_more"]:
            assert page["next_page"] is None
            break
        query = {**query, "page": page["next_page"]}
    assert [b["start_time"] for b in seen] == [T0, T0 + HOUR, T0 + 2 * HOUR]
    _, whole = call(usage_store, usage_completions, hourly(), None)
    assert seen == whole["data"]
    assert sum(r["input_tokens"] for b in seen for r in b["results"]) == 167


def test_daily_buckets_from_the_tenant_rollup(usage_store: StoreSettings) -> None:
    query = {"start_time": str(T0), "end_time": str(T0 + 86400), "group_by": "tenant"}
    _, page = call(usage_store, usage_completions, query, None)
    results = {r["tenant_id"]: r for r in page["data"][0]["results"]}
    assert results["tn_a"]["num_model_requests"] == 3
    assert results["tn_b"]["input_cached_tokens"] == 7


def test_top_keeps_the_groups_largest_over_the_whole_range(usage_store: StoreSettings) -> None:
    """key_1 has 114 tokens over the range, key_2 52: with top=1 only key_1 is listed,
    whatever the page size (the rank is over the range, not the page)."""
    for limit in ("1", "3"):
        query = hourly(group_by="key", top="1", limit=limit)
        keys = set()
        while True:
            _, page = call(usage_store, usage_completions, query, "tn_a")
            keys |= {r["api_key_id"] for b in page["data"] for r in b["results"]}
            if not page["has_more"]:
                break
            query = {**query, "page": page["next_page"]}
        assert keys == {"key_1"}
    _, page = call(usage_store, usage_completions, hourly(group_by="key", top="2"), "tn_a")
    assert {r["api_key_id"] for b in page["data"] for r in b["results"]} == {"key_1", "key_2"}


def test_top_ranks_once_and_later_pages_keep_that_ranking(usage_store: StoreSettings) -> None:
    """Page 1 ranks (key_1 first: 114 tokens to 52) and its cursor carries the ranking:
    page 2 lists key_1 in one query, although key_2 has since become the largest."""
    query = hourly(group_by="key", top="1", limit="1")
    first: list[str] = []
    _, page = call(usage_store, usage_completions, query, "tn_a", first)
    assert listed(page, "api_key_id") == [(T0, "key_1")]
    add(usage_store, [record(5, ts=T0 + HOUR + 30, key_id="key_2", prompt_tokens=10_000)])
    second: list[str] = []
    _, page = call(
        usage_store, usage_completions, {**query, "page": page["next_page"]}, "tn_a", second
    )
    assert listed(page, "api_key_id") == [(T0 + HOUR, "key_1")]
    assert len(first) == 2  # the ranking, then the page
    assert len(second) == 1  # no ranking again: only the page's buckets
    _, page = call(usage_store, usage_completions, {**query, "page": page["next_page"]}, "tn_a")
    assert listed(page, "api_key_id") == []  # hour 2 is tenant b's
    # The control: ranked now, key_2 is the largest.
    _, page = call(usage_store, usage_completions, {**query, "limit": "3"}, "tn_a")
    assert {key for _, key in listed(page, "api_key_id")} == {"key_2"}


def test_a_cursor_from_before_rankings_ranks_again(usage_store: StoreSettings) -> None:
    """A cursor handed out before cursors carried the ranking (base64 of the page start)
    still works: that page ranks, and hands on its ranking."""
    old = "page_" + base64.urlsafe_b64encode(str(T0 + HOUR).encode()).decode().rstrip("=")
    statements: list[str] = []
    query = hourly(group_by="key", top="1", limit="1", page=old)
    status, page = call(usage_store, usage_completions, query, "tn_a", statements)
    assert status == 200 and listed(page, "api_key_id") == [(T0 + HOUR, "key_1")]
    assert len(statements) == 2
    _, page = call(usage_store, usage_completions, {**query, "page": page["next_page"]}, "tn_a")
    assert page["data"][0]["start_time"] == T0 + 2 * HOUR


def test_top_over_several_dimensions_and_unnamed_replicas(store_settings: StoreSettings) -> None:
    """The ranking holds the stored values: several dimensions (row values in SQL), and ''
    for a replica rows did not name (listed as null), across pages."""
    add(
        store_settings,
        [
            record(1, ts=T0, replica=None, prompt_tokens=500),
            record(2, ts=T0 + HOUR, replica=None, prompt_tokens=500),
            record(3, ts=T0 + HOUR, key_id="key_2", prompt_tokens=1),
            record(4, ts=T0, tenant_id="tn_b", key_id="key_b", prompt_tokens=300),
            record(5, ts=T0 + HOUR, tenant_id="tn_b", key_id="key_b", prompt_tokens=300),
        ],
    )
    query = hourly(group_by="tenant,key,replica", top="2", limit="1")
    seen = []
    while True:
        status, page = call(store_settings, usage_completions, query, None)
        assert status == 200
        seen += [
            (b["start_time"], r["tenant_id"], r["api_key_id"], r["replica"])
            for b in page["data"]
            for r in b["results"]
        ]
        if not page["has_more"]:
            break
        query = {**query, "page": page["next_page"]}
    assert seen == [
        (T0, "tn_a", "key_1", None),
        (T0, "tn_b", "key_b", "http://r1:8000"),
        (T0 + HOUR, "tn_a", "key_1", None),
        (T0 + HOUR, "tn_b", "key_b", "http://r1:8000"),
    ]


def test_a_pinned_tenant_sees_nothing_of_a_forged_ranking(usage_store: StoreSettings) -> None:
    """A cursor naming another tenant's group only narrows: the pin still holds in SQL."""
    forged = cursor({"p": T0 + 2 * HOUR, "r": [["tn_b", "key_b"]]})
    query = hourly(group_by="tenant,key", top="5", limit="1", page=forged)
    status, page = call(usage_store, usage_completions, query, "tn_a")
    assert status == 200 and listed(page, "api_key_id") == []
    # The control: unpinned, the same cursor lists tenant b's key.
    _, page = call(usage_store, usage_completions, query, None)
    assert listed(page, "api_key_id") == [(T0 + 2 * HOUR, "key_b")]


def test_a_ranking_too_long_for_the_cursor_is_ranked_again(store_settings: StoreSettings) -> None:
    """Up to 1000 groups of long names would make the cursor tens of kB: past MAX_CURSOR
    the cursor holds only the page start, and the next page ranks again."""
    names = [f"key_{i:02d}_" + "x" * 60 for i in range(40)]
    add(store_settings, [record(i, ts=T0 + i, key_id=name) for i, name in enumerate(names)])
    add(store_settings, [record(100, ts=T0 + HOUR, key_id=names[0])])
    query = hourly(group_by="key", top="1000", limit="1")
    _, page = call(store_settings, usage_completions, query, None)
    assert len(listed(page, "api_key_id")) == 40
    assert len(page["next_page"]) <= MAX_CURSOR
    statements: list[str] = []
    query = {**query, "page": page["next_page"]}
    _, page = call(store_settings, usage_completions, query, None, statements)
    assert listed(page, "api_key_id") == [(T0 + HOUR, names[0])]
    assert len(statements) == 2  # ranked again
    # The control: a short ranking is carried, and the next page does not rank.
    query = hourly(group_by="key", top="3", limit="1")
    _, page = call(store_settings, usage_completions, query, None)
    statements = []
    _, page = call(
        store_settings, usage_completions, {**query, "page": page["next_page"]}, None, statements
    )
    assert listed(page, "api_key_id") == [(T0 + HOUR, names[0])]
    assert len(statements) == 1


@pytest.mark.parametrize(
    "value",
    [
        {"p": T0 + HOUR, "r": "key_1"},
        {"p": T0 + HOUR, "r": [["tn_a", "key_1"]]},
        {"p": T0 + HOUR, "r": [[]]},
        {"p": T0 + HOUR, "r": [["key_1"], ["key_2"], ["key_3"]]},
        {"p": T0 + HOUR, "r": [[1]]},
        {"p": T0 + HOUR, "r": [[None]]},
        {"p": T0 + HOUR, "r": {"key_1": 1}},
        {"p": T0 + HOUR},
        {"p": T0 + HOUR, "r": [["key_1"]], "x": 1},
        {"p": str(T0 + HOUR), "r": [["key_1"]]},
        {"p": True, "r": [["key_1"]]},
        {"p": T0 + HOUR + 1, "r": [["key_1"]]},
        {"p": T0 + 3 * HOUR, "r": [["key_1"]]},
        [T0 + HOUR],
        True,
        None,
        float(T0 + HOUR),
    ],
)
def test_a_cursor_not_of_this_query_is_400(usage_store: StoreSettings, value: object) -> None:
    status, body = call(
        usage_store, usage_completions, hourly(group_by="key", top="2", page=cursor(value)), None
    )
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == "page"


def test_costs_are_decimal_strings_over_micro_dollars(usage_store: StoreSettings) -> None:
    _, page = call(usage_store, costs, hourly(group_by="model"), "tn_a")
    [hour0], [hour1], _ = (b["results"] for b in page["data"])
    assert hour1["amount"] == {"value": "1.500000", "currency": "usd"}
    assert hour1["amount_micro_usd"] == 1_500_000
    assert hour0["amount"]["value"] == "0.000009"  # record() bills 3 micro-dollars per i
    assert hour0["upper_bound_requests"] == 1  # its unknown cached tokens were billed in full


def test_a_pinned_tenant_never_sees_another(usage_store: StoreSettings) -> None:
    _, page = call(
        usage_store, usage_completions, hourly(tenant_ids="tn_b", group_by="tenant"), "tn_a"
    )
    assert all(b["results"] == [] for b in page["data"])
    _, page = call(usage_store, usage_completions, hourly(group_by="tenant"), "tn_a")
    assert {r["tenant_id"] for b in page["data"] for r in b["results"]} == {"tn_a"}
    # The control: unpinned, tenant b is there.
    _, page = call(usage_store, usage_completions, hourly(group_by="tenant"), None)
    assert {r["tenant_id"] for b in page["data"] for r in b["results"]} == {"tn_a", "tn_b"}


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({}, "start_time"),
        ({"start_time": "yesterday"}, "start_time"),
        ({"start_time": "-3600"}, "start_time"),
        (hourly(bucket_width="2h"), "bucket_width"),
        (hourly(end_time="-1"), "end_time"),
        (hourly(end_time=str(T0)), "end_time"),
        (hourly(limit="0"), "limit"),
        (hourly(limit="169"), "limit"),
        ({"start_time": str(T0), "limit": "32"}, "limit"),
        (hourly(group_by="project"), "group_by"),
        (hourly(page="page_bm90IGEgcGFnZQ"), "page"),
        (hourly(page="garbage"), "page"),
        # Nested deeper than json.loads goes (a RecursionError, not a 500).
        (hourly(page="page_" + base64.urlsafe_b64encode(b"[" * 100_000).decode()), "page"),
        (hourly(page=cursor({"p": T0 + HOUR, "r": [["key_1"]]})), "page"),  # ranked, no top
        (hourly(top="3"), "top"),
        (hourly(group_by="key", top="0"), "top"),
    ],
)
def test_bad_parameters_are_400_in_openai_shape(
    usage_store: StoreSettings, query: dict[str, str], param: str
) -> None:
    status, body = call(usage_store, usage_completions, query, None)
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == param and body["error"]["message"]


def test_any_start_time_answers_from_the_bucket_holding_it(usage_store: StoreSettings) -> None:
    """OpenAI documents start_time as inclusive and clients pass "now minus N days": a
    start (and an end) inside a bucket is answered from the buckets holding them, not a
    400 (issue 41)."""
    exact = call(usage_store, usage_completions, hourly(group_by="model"), "tn_a")
    inside = hourly(group_by="model", start_time=str(T0 + 1234), end_time=str(T0 + 2 * HOUR + 5))
    assert call(usage_store, usage_completions, inside, "tn_a") == exact
    status, page = call(usage_store, costs, hourly(start_time=str(T0 + HOUR - 1)), "tn_a")
    assert status == 200 and page["data"][0]["start_time"] == T0


def csv_export(usage_store: StoreSettings, query: dict[str, str]) -> list[bytes]:
    async def go() -> list[bytes]:
        reader = open_usage_reader(usage_store)
        try:
            return [chunk async for chunk in usage_csv(reader, query, "tn_a")]
        finally:
            await reader.aclose()

    return asyncio.run(go())


def test_csv_export_ranges_are_bounded(usage_store: StoreSettings) -> None:
    """Issue 41 finding 11: end_time=60000000000000 made the export read empty pages for
    as long as the client stayed. An export ends with the running bucket, and holds at
    most MAX_CSV_BUCKETS buckets."""
    far = {"start_time": str(T0), "end_time": "60000000000000", "bucket_width": "1d"}
    q = parse_csv_query(far, None, now=T0 + 3 * HOUR)
    assert (q.start, q.end) == (T0, T0 + 86400)  # T0 is a midnight
    until_now = {**far, "end_time": str(int(time.time()))}
    assert csv_export(usage_store, far) == csv_export(usage_store, until_now)
    minutes = T0 + 60 * MAX_CSV_BUCKETS + 60
    for query, now in (
        ({"start_time": str(T0), "end_time": str(minutes), "bucket_width": "1m"}, minutes),
        ({"start_time": "0", "bucket_width": "1h"}, T0),
    ):
        with pytest.raises(ApiError, match="an export holds at most") as refused:
            parse_csv_query(query, None, now=now)
        assert refused.value.status == 400
    year = {
        "start_time": str(T0),
        "end_time": str(T0 + MAX_CSV_BUCKETS * HOUR),
        "bucket_width": "1h",
    }
    assert parse_csv_query(year, None, now=T0 + MAX_CSV_BUCKETS * HOUR).end == int(year["end_time"])


def test_csv_streams_every_bucket_with_unknown_spelled_out(usage_store: StoreSettings) -> None:
    async def go() -> bytes:
        reader = open_usage_reader(usage_store)
        try:
            query = hourly(group_by="key", limit="1")
            return b"".join([chunk async for chunk in usage_csv(reader, query, "tn_a")])
        finally:
            await reader.aclose()

    rows = list(csv.DictReader(io.StringIO(asyncio.run(go()).decode())))
    assert [(r["start_time"], r["api_key_id"], r["input_cached_tokens"]) for r in rows] == [
        (str(T0), "key_1", "40"),
        (str(T0), "key_2", "unknown"),
        (str(T0 + HOUR), "key_1", "0"),
    ]
    assert rows[2]["cost_usd"] == "1.500000"


def test_csv_ranks_top_once_for_the_whole_export(usage_store: StoreSettings) -> None:
    statements: list[str] = []

    async def go() -> bytes:
        reader = Counting(open_usage_reader(usage_store), statements)
        try:
            query = hourly(group_by="key", top="1", limit="1")
            return b"".join([chunk async for chunk in usage_csv(reader, query, "tn_a")])
        finally:
            await reader.aclose()

    rows = list(csv.DictReader(io.StringIO(asyncio.run(go()).decode())))
    assert [(r["start_time"], r["api_key_id"]) for r in rows] == [
        (str(T0), "key_1"),
        (str(T0 + HOUR), "key_1"),
    ]
    assert len(statements) == 1 + 3  # one ranking, then one query per page of 1 bucket


def test_csv_never_hands_a_spreadsheet_a_formula(store_settings: StoreSettings) -> None:
    """A model named like a formula is written as text (`'=...`), as the console's own
    CSV writer did before it became this export."""
    db = open_database(store_settings)
    try:
        db.execute_many(USAGE_INSERT, [record(1, ts=T0, model='=HYPERLINK("x")')])
    finally:
        db.close()

    async def go() -> bytes:
        reader = open_usage_reader(store_settings)
        try:
            query = hourly(group_by="model")
            return b"".join([chunk async for chunk in usage_csv(reader, query, None)])
        finally:
            await reader.aclose()

    [row] = list(csv.DictReader(io.StringIO(asyncio.run(go()).decode())))
    assert row["model"] == '\'=HYPERLINK("x")'


def test_reconcile_answers_ok_and_the_ledger_totals(usage_store: StoreSettings) -> None:
    status, body = call(usage_store, reconcile, {}, None)
    assert status == 200 and body["ok"] is True and body["mismatches"] == []
    assert body["ledger"]["input_tokens"] == 167
    _, pinned = call(usage_store, reconcile, {}, "tn_b")
    assert pinned["ledger"]["requests"] == 1
