"""Prices, the per-tenant usage report (on both backends) and its three renderings."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import math
from pathlib import Path

import pytest

from saltgate.prices import Price, parse_prices
from saltgate.store.backends import open_database, open_gateway_store
from saltgate.store.errors import StoreError
from saltgate.store.ledger import UsageRecord, new_request_id
from saltgate.store.pricing import (
    TenantUsage,
    format_usage,
    parse_since,
    usage_report,
)
from saltgate.store.settings import StoreSettings
from saltgate.store.tenants import TenantStore

LLAMA = Price(input_per_mtok=1.0, cached_input_per_mtok=0.1, output_per_mtok=2.0)


def test_cost_bills_cached_input_separately() -> None:
    # 600 uncached * $1 + 400 cached * $0.1 + 100 out * $2, per million.
    assert LLAMA.cost(1000, 400, 100) == pytest.approx(840e-6)
    assert LLAMA.cost(1000, 0, 0) == pytest.approx(1000e-6)
    # A backend over-reporting cached tokens never yields negative uncached input.
    assert LLAMA.cost(10, 20, 0) == pytest.approx(20 * 0.1e-6)


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan, True])
def test_price_rejects_bad_values(bad: float) -> None:
    with pytest.raises(ValueError, match="input_per_mtok"):
        Price(bad, 0.0, 0.0)


def test_parse_prices() -> None:
    prices = parse_prices({"llama": {"input": 1, "cached_input": 0.1, "output": 2}})
    assert prices == {"llama": LLAMA}
    with pytest.raises(ValueError, match=r"'llama'.*missing \['cached_input'\]"):
        parse_prices({"llama": {"input": 1, "output": 2}})
    with pytest.raises(ValueError, match=r"unknown \['inptu'\]"):
        parse_prices({"llama": {"inptu": 1, "cached_input": 0.1, "output": 2}})
    with pytest.raises(ValueError, match=r"'llama'.*>= 0"):
        parse_prices({"llama": {"input": -1, "cached_input": 0.1, "output": 2}})


def test_parse_since() -> None:
    now = 1_700_000_000.0
    assert parse_since("24h", now) == now - 86400
    assert parse_since("90m", now) == now - 5400
    assert parse_since("7d", now) == now - 7 * 86400
    assert parse_since("2023-11-14T22:13:20", now) == 1_700_000_000.0  # naive = UTC
    assert parse_since("2023-11-14T23:13:20+01:00", now) == 1_700_000_000.0
    with pytest.raises(ValueError, match="expected a duration"):
        parse_since("yesterday", now)


def _seed(settings: StoreSettings) -> tuple[str, str, str]:
    with TenantStore(open_database(settings)) as store:
        acme = store.create_tenant("acme").id
        globex = store.create_tenant("globex").id
        idle = store.create_tenant("idle").id
    records = [
        (100.0, acme, "key_a", "llama", 1000, 400, 100, 200),
        (200.0, acme, "key_a", "llama", 2000, 2000, 50, 200),
        (300.0, acme, "key_b", "mystery", 500, 0, 10, 200),
        (150.0, globex, "key_g", "llama", 10, 0, 0, 429),
        (250.0, "tn_gone", "key_x", "llama", 1_000_000, 0, 0, 200),
    ]

    async def write() -> None:
        store = await open_gateway_store(settings)  # the gateway's own ledger
        ledger = store.ledger
        await asyncio.gather(*(ledger.record(UsageRecord(new_request_id(), *r)) for r in records))
        await store.aclose()

    asyncio.run(write())
    return acme, globex, idle


def _report(
    settings: StoreSettings, since: float | None, prices: dict[str, Price]
) -> list[TenantUsage]:
    db = open_database(settings, create=False)
    try:
        return usage_report(db, since, prices)
    finally:
        db.close()


def test_usage_report_totals(store_settings: StoreSettings) -> None:
    acme, globex, idle = _seed(store_settings)
    rows = _report(store_settings, None, {"llama": LLAMA})
    by_id = {r.tenant_id: r for r in rows}
    assert [r.tenant_name for r in rows] == ["acme", "globex", "idle", None]

    a = by_id[acme]
    assert (a.requests, a.errors) == (3, 0)
    assert (a.prompt_tokens, a.cached_tokens, a.completion_tokens) == (3500, 2400, 160)
    # llama only: (600*1 + 400*0.1 + 100*2) + (0*1 + 2000*0.1 + 50*2); "mystery" is free.
    assert a.cost_usd == pytest.approx((840 + 300) / 1e6)
    assert a.unpriced_models == ("mystery",)

    g = by_id[globex]
    assert (g.requests, g.errors) == (1, 1)
    assert g.cost_usd == pytest.approx(10e-6)
    assert by_id[idle] == TenantUsage(idle, "idle", 0, 0, 0, 0, 0, 0.0, ())
    assert by_id["tn_gone"].cost_usd == pytest.approx(1.0)

    since = _report(store_settings, 200.0, {"llama": LLAMA})
    a2 = {r.tenant_id: r for r in since}[acme]
    assert (a2.requests, a2.prompt_tokens) == (2, 2500)  # ts >= 200 only
    assert {r.tenant_id: r.requests for r in since}[globex] == 0


def test_usage_report_needs_an_existing_db(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no saltgate database"):
        _report(StoreSettings.in_state_dir(tmp_path / "nope"), None, {})
    assert not (tmp_path / "nope").exists()  # a report never creates state


def test_format_usage(tmp_path: Path) -> None:
    settings = StoreSettings.in_state_dir(tmp_path)
    acme, _, _ = _seed(settings)
    rows = _report(settings, None, {"llama": LLAMA})

    data = json.loads(format_usage(rows, "json"))
    assert data[0]["tenant"] == "acme" and data[0]["tenant_id"] == acme
    assert data[0]["cost_usd"] == pytest.approx(1140e-6)
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
