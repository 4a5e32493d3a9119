"""Prices and their versions, each request's cost recorded with it, and the usage report
(`saltgate usage`) on both backends, in its three renderings (docs/billing.md)."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import math
import random
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path

import pytest

from saltgate.prices import Price, PriceVersion, micro_per_mtok, parse_prices, price_versions
from saltgate.store.backends import open_database, open_gateway_store
from saltgate.store.errors import StoreError
from saltgate.store.ledger import UsageRecord, new_request_id
from saltgate.store.pricing import (
    UsageRow,
    format_usage,
    parse_group_by,
    parse_time,
    usage_report,
    usd,
)
from saltgate.store.settings import StoreSettings
from saltgate.store.tenants import TenantStore

LLAMA = Price(input_per_mtok=1.0, cached_input_per_mtok=0.1, output_per_mtok=2.0)
V_LLAMA = PriceVersion.of("llama", LLAMA)
DAY = 86400.0
NOV_1 = 1_793_491_200.0  # 2026-11-01T00:00:00Z


@pytest.mark.unit
def test_cost_is_integer_micro_dollars_billing_cached_input_separately() -> None:
    # 600 uncached * $1 + 400 cached * $0.1 + 100 out * $2, per million: 840 micro-dollars.
    assert V_LLAMA.cost_micro_usd(1000, 400, 100) == 840
    assert V_LLAMA.cost_micro_usd(1000, 0, 0) == 1000
    # A backend over-reporting cached tokens never yields negative uncached input.
    assert V_LLAMA.cost_micro_usd(10, 20, 0) == 2
    # Unknown cached tokens: the whole prompt at the input price, an upper bound.
    assert V_LLAMA.cost_micro_usd(1000, None, 100) == 1200
    # Rounded once per request, half up: 5 tokens at $0.1/M is 0.5 micro-dollars.
    cheap = PriceVersion.of("m", Price(0.1, 0.1, 0.1))
    assert (cheap.cost_micro_usd(4, 0, 0), cheap.cost_micro_usd(5, 0, 0)) == (0, 1)
    # Decimal prices are exact: 0.15 is not the float 0.1499999...
    odd = PriceVersion.of("m", Price(0.15, 0.075, 0.6))
    assert (odd.input, odd.cached_input, odd.output) == (150_000, 75_000, 600_000)
    assert odd.cost_micro_usd(10, 0, 0) == 2  # 1.5 -> 2


@pytest.mark.unit
def test_a_price_version_names_the_model_and_its_prices() -> None:
    assert PriceVersion.of("llama", LLAMA) == V_LLAMA  # the same on every gateway
    assert V_LLAMA.version.startswith("pv_") and len(V_LLAMA.version) == 19
    assert PriceVersion.of("other", LLAMA).version != V_LLAMA.version
    dearer = Price(1.0, 0.1, 2.5)
    assert PriceVersion.of("llama", dearer).version != V_LLAMA.version
    assert price_versions({"llama": LLAMA}) == {"llama": V_LLAMA}


@pytest.mark.unit
@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan, True, 0.1234567])
def test_price_rejects_bad_values(bad: float) -> None:
    with pytest.raises(ValueError, match="input_per_mtok"):
        Price(bad, 0.0, 0.0)


@pytest.mark.unit
def test_prices_are_whole_micro_dollars_per_million_tokens() -> None:
    assert micro_per_mtok(0.000001) == 1 and micro_per_mtok(3) == 3_000_000
    with pytest.raises(ValueError, match="more than 6 decimal places"):
        micro_per_mtok(1e-7)


@pytest.mark.unit
def test_parse_prices() -> None:
    prices = parse_prices({"llama": {"input": 1, "cached_input": 0.1, "output": 2}})
    assert prices == {"llama": LLAMA}
    with pytest.raises(ValueError, match=r"'llama'.*missing \['cached_input'\]"):
        parse_prices({"llama": {"input": 1, "output": 2}})
    with pytest.raises(ValueError, match=r"unknown \['inptu'\]"):
        parse_prices({"llama": {"inptu": 1, "cached_input": 0.1, "output": 2}})
    with pytest.raises(ValueError, match=r"'llama'.*>= 0"):
        parse_prices({"llama": {"input": -1, "cached_input": 0.1, "output": 2}})


@pytest.mark.unit
def test_parse_time() -> None:
    now = 1_700_000_000.0
    assert parse_time("24h", now) == now - 86400
    assert parse_time("90m", now) == now - 5400
    assert parse_time("7d", now) == now - 7 * 86400
    assert parse_time("2023-11-14T22:13:20", now) == 1_700_000_000.0  # naive = UTC
    assert parse_time("2023-11-14T23:13:20+01:00", now) == 1_700_000_000.0
    assert parse_time("2026-11-01", now) == NOV_1  # a date is its UTC midnight
    assert parse_time("2026-11-01T00:00:00Z", now) == NOV_1
    with pytest.raises(ValueError, match="--until 'yesterday': expected a duration"):
        parse_time("yesterday", now, "--until")


@pytest.mark.unit
def test_parse_group_by() -> None:
    assert parse_group_by("day,tenant") == ("tenant", "day")  # the report's column order
    assert parse_group_by("tenant,key,model,day") == ("tenant", "key", "model", "day")
    for bad in ("", "tenant,week", ","):
        with pytest.raises(ValueError, match="--group-by"):
            parse_group_by(bad)


def _tenants(settings: StoreSettings, *names: str) -> list[str]:
    with TenantStore(open_database(settings)) as store:
        return [store.create_tenant(name).id for name in names]


Metered = tuple[float, str, str, str, int, int | None, int, int]


def _record(
    settings: StoreSettings, records: Sequence[Metered], prices: dict[str, Price] | None = None
) -> list[UsageRecord]:
    """Meter `records` (ts, tenant, key, model, prompt, cached, completion, status) as the
    gateway does: through its own ledger, each priced when recorded with `prices`."""
    versions = price_versions(prices or {})
    recs = []
    for ts, tenant, key, model, prompt, cached, completion, status in records:
        v = versions.get(model)
        cost = None if v is None else v.cost_micro_usd(prompt, cached, completion)
        recs.append(
            UsageRecord(
                new_request_id(),
                ts,
                tenant,
                key,
                model,
                prompt,
                cached,
                completion,
                status,
                cost,
                None if v is None else v.version,
            )
        )

    async def write() -> None:
        store = await open_gateway_store(settings, prices=versions.values())
        await asyncio.gather(*(store.ledger.record(r) for r in recs))
        await store.aclose()

    asyncio.run(write())
    return recs


def _report(
    settings: StoreSettings,
    prices: dict[str, Price],
    since: float | None = None,
    until: float | None = None,
    group_by: Sequence[str] = ("tenant",),
) -> list[UsageRow]:
    db = open_database(settings, create=False)
    try:
        return usage_report(db, since, prices, until=until, group_by=group_by)
    finally:
        db.close()


def _seed(settings: StoreSettings) -> tuple[str, str, str]:
    acme, globex, idle = _tenants(settings, "acme", "globex", "idle")
    _record(
        settings,
        [
            (100.0, acme, "key_a", "llama", 1000, 400, 100, 200),
            (200.0, acme, "key_a", "llama", 2000, 2000, 50, 200),
            (300.0, acme, "key_b", "mystery", 500, 0, 10, 200),
            (150.0, globex, "key_g", "llama", 10, 0, 0, 429),
            (250.0, "tn_gone", "key_x", "llama", 1_000_000, 0, 0, 200),
        ],
        {"llama": LLAMA},
    )
    return acme, globex, idle


def test_usage_report_totals(store_settings: StoreSettings) -> None:
    acme, globex, idle = _seed(store_settings)
    rows = _report(store_settings, {"llama": LLAMA})
    by_id = {r.tenant_id: r for r in rows}
    assert [r.tenant_name for r in rows] == ["acme", "globex", "idle", None]

    a = by_id[acme]
    assert (a.requests, a.errors) == (3, 0)
    assert (a.prompt_tokens, a.cached_tokens, a.completion_tokens) == (3500, 2400, 160)
    # llama only: (600*1 + 400*0.1 + 100*2) + (0*1 + 2000*0.1 + 50*2); "mystery" is free.
    assert a.cost_micro_usd == 840 + 300
    assert a.unpriced_models == ("mystery",)
    assert a.priced_at_report_requests == 0 and a.unknown_cached_requests == 0

    g = by_id[globex]
    assert (g.requests, g.errors, g.cost_micro_usd) == (1, 1, 10)
    assert by_id[idle] == UsageRow(idle, "idle", None, None, None, 0, 0, 0, 0, 0, 0, 0, 0, 0, ())
    assert by_id["tn_gone"].cost_micro_usd == 1_000_000

    since = _report(store_settings, {"llama": LLAMA}, since=200.0)
    a2 = {r.tenant_id: r for r in since}[acme]
    assert (a2.requests, a2.prompt_tokens) == (2, 2500)  # ts >= 200 only
    assert {r.tenant_id: r.requests for r in since}[globex] == 0


def test_a_price_change_after_the_records_keeps_their_cost(store_settings: StoreSettings) -> None:
    """The report reads the recorded cost: today's [prices] re-price nothing recorded,
    and each price version the gateways billed with is kept, with when it came into use."""
    (acme,) = _tenants(store_settings, "acme")
    _record(store_settings, [(100.0, acme, "k", "llama", 1000, 400, 100, 200)], {"llama": LLAMA})
    dearer = Price(10.0, 1.0, 20.0)
    _record(store_settings, [(200.0, acme, "k", "llama", 1000, 400, 100, 200)], {"llama": dearer})
    [row] = _report(store_settings, {"llama": Price(99.0, 99.0, 99.0)})
    assert row.cost_micro_usd == 840 + 8400 and row.priced_at_report_requests == 0
    assert _report(store_settings, {}) == [row]  # no price today: the past still costs

    db = open_database(store_settings, create=False)
    try:
        versions = db.query(
            "SELECT u.ts, p.version, p.input_micro_usd_per_mtok, p.effective_from "
            "FROM usage u JOIN prices p ON p.version = u.price_version ORDER BY u.ts"
        )
    finally:
        db.close()
    v_dearer = PriceVersion.of("llama", dearer)
    assert [(ts, v, p) for ts, v, p, _ in versions] == [
        (100.0, V_LLAMA.version, 1_000_000),
        (200.0, v_dearer.version, 10_000_000),
    ]
    assert versions[0][3] <= versions[1][3]  # the first version came into use first


def test_rows_without_a_recorded_cost_are_priced_now_and_flagged(
    store_settings: StoreSettings,
) -> None:
    """Rows from before the cost columns (or of a model then unpriced) are priced per row
    at today's prices, rounded as the gateway rounds, and counted as such."""
    (acme,) = _tenants(store_settings, "acme")
    _record(
        store_settings,
        [
            (100.0, acme, "k", "llama", 5, 0, 0, 200),  # 0.5 -> 1 micro-dollar
            (101.0, acme, "k", "llama", 5, 0, 0, 200),
            (102.0, acme, "k", "mystery", 7, 0, 0, 200),
        ],
    )
    cheap = {"llama": Price(0.1, 0.1, 0.1)}
    [row] = _report(store_settings, cheap)
    assert row.cost_micro_usd == 2  # per row (1 + 1), not the sum's 1
    assert row.priced_at_report_requests == 2 and row.unpriced_models == ("mystery",)
    assert format_usage([row], "table").splitlines()[-2:] == [
        "* no price configured (counted as $0) for: mystery",
        "~ 2 requests were recorded without a cost and are priced at today's prices",
    ]


def test_unknown_cached_tokens_are_unknown_and_the_cost_an_upper_bound(
    store_settings: StoreSettings,
) -> None:
    acme, globex = _tenants(store_settings, "acme", "globex")
    _record(
        store_settings,
        [
            (100.0, acme, "k", "llama", 1000, None, 100, 200),
            (101.0, acme, "k", "llama", 1000, 400, 100, 200),
            (102.0, globex, "g", "llama", 1000, 0, 100, 200),
        ],
        {"llama": LLAMA},
    )
    rows = _report(store_settings, {"llama": LLAMA})
    a, g = rows
    assert a.cached_tokens is None and g.cached_tokens == 0  # a reported 0 stays 0
    assert (a.unknown_cached_requests, a.unknown_cached_prompt_tokens) == (1, 1000)
    assert a.cost_micro_usd == 1200 + 840  # the unknown one at the full input price

    [j, _] = json.loads(format_usage(rows, "json"))
    assert j["cached_tokens"] is None and j["unknown_cached_requests"] == 1
    assert j["cost_usd"] == "0.002040"
    [c, c2] = csv.DictReader(io.StringIO(format_usage(rows, "csv")))
    assert (c["cached_tokens"], c["unknown_cached_prompt_tokens"]) == ("unknown", "1000")
    assert c2["cached_tokens"] == "0"
    lines = format_usage(rows, "table").splitlines()
    acme_line = next(ln for ln in lines if ln.startswith("acme")).split()
    assert acme_line[5:7] == ["unknown", "-"] and acme_line[-1] == "0.002040^"
    total = next(ln for ln in lines if ln.startswith("TOTAL")).split()
    assert total[4] == "unknown"
    assert lines[-1] == (
        "^ an upper bound: 1 requests did not report cached tokens; their 1000 prompt "
        "tokens are billed at the full input price"
    )


def test_closing_a_month_every_grouping_adds_up_exactly(store_settings: StoreSettings) -> None:
    """[since, until) in UTC, any grouping: the amounts are exact decimals of the recorded
    micro-dollars, so every grouping's groups add up to the same total, to the digit."""
    tenants = _tenants(store_settings, "acme", "globex")
    rng = random.Random(21)
    prices = {"a": Price(0.15, 0.075, 0.6), "b": Price(3.0, 0.3, 15.0)}
    month: list[Metered] = [
        (
            NOV_1 + rng.uniform(0, 30 * DAY),
            rng.choice(tenants),
            rng.choice(("key_1", "key_2")),
            rng.choice(("a", "b")),
            rng.randint(1, 5000),
            rng.choice((None, rng.randint(0, 1000))),
            rng.randint(0, 500),
            rng.choice((200, 200, 499, 500)),
        )
        for _ in range(300)
    ]
    edges: list[Metered] = [
        (NOV_1, tenants[0], "key_1", "a", 10, 0, 0, 200),  # since is inclusive
        (NOV_1 - 0.001, tenants[0], "key_1", "a", 10_000, 0, 0, 200),  # October
        (NOV_1 + 30 * DAY, tenants[0], "key_1", "a", 10_000, 0, 0, 200),  # until: December
    ]
    recs = _record(store_settings, month + edges, prices)
    in_month = [r for r in recs if NOV_1 <= r.ts < NOV_1 + 30 * DAY]
    assert len(in_month) == 301
    exact = Decimal(sum(r.cost_micro_usd or 0 for r in in_month)) / 1_000_000

    totals = set()
    for group_by in (("tenant",), ("tenant", "key", "model", "day"), ("day",), ("model", "key")):
        rows = _report(store_settings, prices, NOV_1, NOV_1 + 30 * DAY, group_by)
        assert sum(r.requests for r in rows) == 301
        as_json = json.loads(format_usage(rows, "json", group_by))
        as_csv = list(csv.DictReader(io.StringIO(format_usage(rows, "csv", group_by))))
        for out in (as_json, as_csv):
            amounts = [Decimal(r["cost_usd"]) for r in out]
            assert all(a.as_tuple().exponent == -6 for a in amounts)  # "12.345678"
            totals.add(sum(amounts))
        assert [r["cost_usd"] for r in as_json] == [r["cost_usd"] for r in as_csv]
        table_total = format_usage(rows, "table", group_by).splitlines()
        total_line = next(ln for ln in table_total if ln.startswith("TOTAL"))
        assert Decimal(total_line.split()[-1].rstrip("*^~")) == exact
    assert totals == {exact}

    days = _report(store_settings, prices, NOV_1, NOV_1 + 30 * DAY, ("tenant", "day"))
    assert {r.day for r in days} <= {f"2026-11-{d:02d}" for d in range(1, 31)}
    first = [r for r in days if r.day == "2026-11-01"]
    assert first and all(r.tenant_name in ("acme", "globex") for r in first)
    keyed = json.loads(format_usage(days, "json", ("tenant", "day")))[0]
    assert list(keyed)[:3] == ["tenant", "tenant_id", "day"]


@pytest.mark.unit
def test_usd_is_exact() -> None:
    assert [usd(0), usd(1), usd(1_140), usd(12_345_678)] == [
        "0.000000",
        "0.000001",
        "0.001140",
        "12.345678",
    ]


@pytest.mark.unit
def test_usage_report_needs_an_existing_db(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no saltgate database"):
        _report(StoreSettings.in_state_dir(tmp_path / "nope"), {})
    assert not (tmp_path / "nope").exists()  # a report never creates state


@pytest.mark.unit
def test_format_usage(tmp_path: Path) -> None:
    settings = StoreSettings.in_state_dir(tmp_path)
    acme, _, _ = _seed(settings)
    rows = _report(settings, {"llama": LLAMA})

    data = json.loads(format_usage(rows, "json"))
    assert data[0]["tenant"] == "acme" and data[0]["tenant_id"] == acme
    assert data[0]["cost_usd"] == "0.001140"
    assert data[0]["unpriced_models"] == ["mystery"]
    assert data[-1]["tenant"] is None

    parsed = list(csv.DictReader(io.StringIO(format_usage(rows, "csv"))))
    assert len(parsed) == 4
    assert parsed[0]["tenant"] == "acme" and parsed[0]["prompt_tokens"] == "3500"
    assert parsed[0]["cost_usd"] == "0.001140" and parsed[0]["unpriced_models"] == "mystery"

    for fmt in ("table", "json", "csv"):
        assert not format_usage(rows, fmt).endswith("\n")  # print() adds the one newline
    table = format_usage(rows, "table")
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["TENANT", "ID", "REQUESTS"]
    acme_line = next(ln for ln in lines if ln.startswith("acme"))
    assert acme_line.split()[-1] == "0.001140*"
    assert "68.6" in acme_line.split()  # cached share of prompt tokens, percent
    total = next(ln for ln in lines if ln.startswith("TOTAL")).split()
    assert total[1:3] == ["5", "1"]  # requests, errors
    assert lines[-1] == "* no price configured (counted as $0) for: mystery"
    assert "(deleted)" in table
    with pytest.raises(ValueError, match="unknown usage format"):
        format_usage(rows, "xml")  # type: ignore[arg-type]
