"""The usage rollups equal the ledger, to the token, on both backends: after the
migration's backfill, after every ledger write (the SQLite ledger, PgLedger, a replayed
spool), after a prune; and `reconcile` notices when they do not."""

from __future__ import annotations

import asyncio
import sqlite3
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.support.postgres import new_database

from saltgate.store.backends import migrate_store, open_database
from saltgate.store.ledger import USAGE_INSERT, Ledger, UsageRecord
from saltgate.store.lifecycle import prune_usage
from saltgate.store.pg_ledger import PgLedger
from saltgate.store.postgres import conninfo
from saltgate.store.schema import POSTGRES_MIGRATIONS, ROLLUPS, SQLITE_MIGRATIONS
from saltgate.store.settings import StoreSettings
from saltgate.store.spool import Spool
from saltgate.store.usage_rollups import open_usage_reader, read_buckets, reconcile
from saltgate_devkit.services import PostgresServer

DAY = 86400
T0 = 1_790_000_000 // DAY * DAY  # a UTC midnight in 2026


def record(i: int, **fields: Any) -> UsageRecord:
    base: dict[str, Any] = {
        "request_id": f"r{i:08d}",
        "ts": T0 + i * 37.5,
        "tenant_id": "tn_a",
        "key_id": "key_1",
        "model": "m",
        "prompt_tokens": 100 + i,
        "cached_tokens": i % 7,
        "completion_tokens": i % 11,
        "status": 200,
        "cost_micro_usd": 3 * i,
        "price_version": "pv_x",
        "replica": "http://r1:8000",
    }
    return UsageRecord(**{**base, **fields})


def expected(records: list[UsageRecord], width: int) -> dict[tuple[Any, ...], dict[str, int]]:
    """The ledger summed in Python, per (bucket, tenant, key, model, replica)."""
    out: dict[tuple[Any, ...], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in {r.request_id: r for r in reversed(records)}.values():  # the first one counts
        s = out[(int(r.ts) // width * width, r.tenant_id, r.key_id, r.model, r.replica)]
        s["requests"] += 1
        s["errors"] += r.status >= 400
        s["input_tokens"] += r.prompt_tokens
        s["cached_tokens"] += r.cached_tokens or 0
        s["cached_unknown_requests"] += r.cached_tokens is None
        s["cached_unknown_input_tokens"] += r.prompt_tokens if r.cached_tokens is None else 0
        s["output_tokens"] += r.completion_tokens
        s["cost_micro_usd"] += r.cost_micro_usd or 0
        s["unpriced_requests"] += r.cost_micro_usd is None
    return {k: dict(v) for k, v in out.items()}


async def rollups(settings: StoreSettings, width: int) -> dict[tuple[Any, ...], dict[str, int]]:
    reader = open_usage_reader(settings)
    try:
        groups = await read_buckets(
            reader,
            width,
            0,
            2**40,
            group_by=("tenant_id", "key_id", "model", "replica"),
            filters={},
        )
    finally:
        await reader.aclose()
    return {
        (g.bucket, g.dims["tenant_id"], g.dims["key_id"], g.dims["model"], g.dims["replica"]): dict(
            g.sums
        )
        for g in groups
    }


async def check_equal(settings: StoreSettings, records: list[UsageRecord]) -> None:
    """Every width read from the rollups equals the ledger summed in Python, and
    reconcile finds every rollup table equal to the ledger."""
    for width in (60, 3600, DAY):
        assert await rollups(settings, width) == expected(records, width)
    reader = open_usage_reader(settings)
    try:
        totals, mismatches = await reconcile(reader)
    finally:
        await reader.aclose()
    assert mismatches == []
    assert totals["requests"] == len({r.request_id for r in records})


async def write(settings: StoreSettings, records: list[UsageRecord], tmp: Path) -> None:
    """Through the gateway's own ledger of the backend: group commits of many records."""
    open_database(settings).close()  # migrated, as the gateway's store opens it
    if settings.backend == "sqlite":
        assert settings.sqlite_path is not None
        ledger = Ledger(settings.sqlite_path)
        await asyncio.gather(*(ledger.record(r) for r in records))
        ledger.close()
        return
    pg = PgLedger(settings, spool=Spool(tmp / "spool"))
    await pg.start()
    await asyncio.gather(*(pg.record(r) for r in records))
    await pg.aclose()
    assert pg.spooled == 0


def test_ledger_writes_keep_rollups_equal_to_the_ledger(
    store_settings: StoreSettings, tmp_path: Path
) -> None:
    records = [record(i) for i in range(300)]
    records += [
        record(300, cached_tokens=None),  # unknown, counted apart
        record(301, cost_micro_usd=None, price_version=None, status=502),
        record(302, replica=None, tenant_id="tn_b"),
        record(5, prompt_tokens=10**6),  # a retried id: kept once, as first written
    ]
    asyncio.run(write(store_settings, records, tmp_path))
    asyncio.run(check_equal(store_settings, records))
    hours = asyncio.run(rollups(store_settings, 3600))
    unknown = [s for s in hours.values() if s["cached_unknown_requests"]]
    assert unknown == [unknown[0]] and unknown[0]["cached_unknown_input_tokens"] == 400
    assert any(k[4] is None for k in hours)  # no replica recorded: None, not ''


def test_a_replayed_spool_lands_in_the_rollups(pg_store: StoreSettings, tmp_path: Path) -> None:
    """Records an earlier process spooled are replayed at start, rollups and all."""
    records = [record(i, tenant_id="tn_spooled") for i in range(50)]

    open_database(pg_store).close()

    async def go() -> None:
        spool = Spool(tmp_path / "spool")
        await spool.append(records)
        await spool.seal()
        pg = PgLedger(pg_store, spool=Spool(tmp_path / "spool"))
        await pg.start()
        try:
            for _ in range(400):  # until the replay is done (or fail after ~20 s)
                if pg.replayed == len(records):
                    break
                await asyncio.sleep(0.05)
            assert pg.replayed == len(records)
        finally:
            await pg.aclose()
        await check_equal(pg_store, records)

    asyncio.run(go())


def test_prune_takes_rows_out_of_the_rollups(store_settings: StoreSettings, tmp_path: Path) -> None:
    records = [record(i) for i in range(400)]
    asyncio.run(write(store_settings, records, tmp_path))
    cutoff = T0 + 200 * 37.5 + 1  # inside an hour and a minute bucket: they are split
    db = open_database(store_settings)
    try:
        assert prune_usage(db, cutoff, batch_rows=64).deleted == 201
    finally:
        db.close()
    asyncio.run(check_equal(store_settings, [r for r in records if r.ts >= cutoff]))


def test_reconcile_finds_a_rollup_off_by_one_token(
    store_settings: StoreSettings, tmp_path: Path
) -> None:
    """The positive control: a rollup that disagrees by one token is reported."""
    asyncio.run(write(store_settings, [record(i) for i in range(20)], tmp_path))
    db = open_database(store_settings)
    try:
        db.execute(
            "UPDATE usage_rollup_1h SET output_tokens = output_tokens + 1 WHERE bucket = ?", (T0,)
        )
    finally:
        db.close()

    async def go() -> None:
        reader = open_usage_reader(store_settings)
        try:
            _, mismatches = await reconcile(reader)
        finally:
            await reader.aclose()
        assert [(m.table, m.rows_only_in_ledger, m.rows_only_in_rollup) for m in mismatches] == [
            ("usage_rollup_1h", 1, 1)
        ]

    asyncio.run(go())


# -- the migration's backfill -------------------------------------------------------------

OLD_ROWS = [record(i, replica=None) for i in range(120)] + [
    record(200, cached_tokens=None, replica=None)
]


def _old_sqlite(path: Path) -> None:
    """A database at version 6 (before the rollups) with usage rows."""
    conn = sqlite3.connect(path, isolation_level=None)
    for m in SQLITE_MIGRATIONS:
        if m.version <= 6:
            for stmt in m.statements:
                conn.execute(stmt)
    conn.execute("PRAGMA user_version = 6")
    conn.executemany(
        USAGE_INSERT.replace(", replica)", ")").replace(", ?)", ")", 1), [r[:-1] for r in OLD_ROWS]
    )
    conn.close()


def _old_postgres(settings: StoreSettings) -> None:
    with psycopg.connect(conninfo(settings), autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE schema_version "
            "(version INTEGER PRIMARY KEY, name TEXT, applied_at DOUBLE PRECISION)"
        )
        for m in POSTGRES_MIGRATIONS:
            if m.version <= 6:
                for stmt in m.statements:
                    conn.execute(stmt)
                conn.execute("INSERT INTO schema_version VALUES (%s, %s, 0)", (m.version, m.name))
        with conn.cursor() as cur:
            cur.executemany(
                USAGE_INSERT.replace(", replica)", ")").replace(", ?)", ")", 1).replace("?", "%s"),
                [r[:-1] for r in OLD_ROWS],
            )


def test_the_migration_backfills_rollups_from_the_ledger(
    store_settings: StoreSettings,
) -> None:
    if store_settings.backend == "sqlite":
        assert store_settings.sqlite_path is not None
        store_settings.sqlite_path.parent.mkdir(parents=True, exist_ok=True)
        _old_sqlite(store_settings.sqlite_path)
    else:
        _old_postgres(store_settings)
    migrate_store(store_settings)  # `saltgate store migrate`: to the current version
    asyncio.run(check_equal(store_settings, OLD_ROWS))
    assert len(ROLLUPS) == 3


# -- the property: random writes, prunes and retries --------------------------------------

records_strategy = st.lists(
    st.builds(
        UsageRecord,
        request_id=st.integers(0, 60).map(lambda i: f"r{i}"),  # repeats: retried commits
        ts=st.floats(T0, T0 + 3 * DAY, allow_nan=False),
        tenant_id=st.sampled_from(["tn_a", "tn_b", "tn_c"]),
        key_id=st.sampled_from(["key_1", "key_2"]),
        model=st.sampled_from(["m", "n"]),
        prompt_tokens=st.integers(0, 2**31 - 1),
        cached_tokens=st.none() | st.integers(0, 2**31 - 1),
        completion_tokens=st.integers(0, 2**31 - 1),
        status=st.sampled_from([200, 499, 502, 503]),
        cost_micro_usd=st.none() | st.integers(0, 2**53),
        price_version=st.just("pv_x"),
        replica=st.none() | st.sampled_from(["http://r1:8000", "http://r2:8000"]),
    ),
    max_size=80,
)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(first=records_strategy, second=records_strategy, prune_at=st.floats(T0, T0 + 3 * DAY))
def test_property_rollups_equal_the_ledger_to_the_token(
    backend: str,
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    *,
    first: list[UsageRecord],
    second: list[UsageRecord],
    prune_at: float,
) -> None:
    """Any two batches of records (ids repeating), with a prune between them: the
    rollups, read at every width, are the surviving ledger rows summed exactly."""
    tmp = tmp_path_factory.mktemp("prop")
    if backend == "sqlite":
        settings_ = StoreSettings.in_state_dir(tmp / "state")
    else:
        server: PostgresServer = request.getfixturevalue("postgres_server")
        settings_ = new_database(server, tmp)
    asyncio.run(write(settings_, first, tmp))
    db = open_database(settings_)
    try:
        prune_usage(db, prune_at, batch_rows=16)
    finally:
        db.close()
    kept = [r for r in {r.request_id: r for r in reversed(first)}.values() if r.ts >= prune_at]
    asyncio.run(write(settings_, second, tmp))
    asyncio.run(check_equal(settings_, kept + second))
