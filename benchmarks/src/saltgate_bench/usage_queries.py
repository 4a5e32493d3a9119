"""How fast usage queries answer from the rollups with a large ledger, on either backend.

    .venv/bin/saltgate-bench usage-queries --rows 10000000 --store sqlite|postgres

Fills a fresh store (SQLite in a temporary directory, or a PostgreSQL server of its own,
started as the tests start it) with `--rows` ledger rows over 90 days, written by SQL in
large statements so that the rollup triggers run as they do for the gateway's ledger,
and `--keys` API keys. Then measures, in a process of its own, `--runs` times each,
through the same functions the APIs serve (admin/usage.py): one tenant's 30-day hourly
series (every page), every tenant's 90-day daily series and its top 10, and a page of the
key list by keyset pagination (at a random point of the 1,000,000). Prints the p95 of each
against its target; results go to docs/benchmarks.md ("Usage queries").
"""

# ruff: noqa: S608 - the SQL holds only numbers computed here

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from saltgate.admin.usage import usage_completions
from saltgate.store.backends import open_database
from saltgate.store.db import Database
from saltgate.store.schema import SQLITE_ROLLUP_TRIGGER, rollup_backfill, sqlite_rollup_trigger
from saltgate.store.settings import StoreSettings
from saltgate.store.usage_rollups import UsageReader, open_usage_reader
from saltgate_devkit.services import PostgresServer

HELP = "usage query latency from the rollups with a large ledger (SQLite or PostgreSQL)"
DAY = 86400
DAYS = 90
CHUNK = 1_000_000  # ledger rows per INSERT statement
FILL_CACHE_KIB = 1_048_576  # the loading connection's page cache / work memory (1 GiB)
KEYS_PAGE = 100
# Each row's tenant, key, model, ... from its number, the same on both backends. Not
# random(): SQLite flattens the subquery and calls random() again for every use of the
# value, so a row's key belonged to another tenant than the row (twice the hourly rollup
# rows PostgreSQL had from the same --rows).
SCRAMBLE = "i * 2654435761 % 1000003"
Timings = dict[str, list[float]]  # seconds, by query name
TOP_N = 10  # the tenants with the most tokens over the 90 days
TARGETS_MS = {
    "tenant 30-day hourly": 50.0,
    "all tenants 90-day daily top-N": 300.0,
    "key list page": 100.0,
}


def _ledger_chunk(
    pg: bool, first: int, count: int, *, start: int, step: float, tenants: int
) -> str:
    """INSERT .. SELECT of `count` rows numbered from `first`, ts rising like a ledger's
    (request ids too, so their unique index grows at its end instead of everywhere);
    each tenant has 3 keys with traffic, 2 models, 2 replicas; 1 in 10 without cached
    tokens. Numbers only: nothing the user gives reaches this SQL."""
    if pg:
        rows = f"SELECT i FROM generate_series({first}, {first + count - 1}) AS g(i)"
        request_id = "'r' || lpad(i::text, 10, '0')"
    else:
        rows = (
            f"WITH RECURSIVE g(i) AS (SELECT {first} UNION ALL SELECT i + 1 FROM g "
            f"WHERE i < {first + count - 1}) SELECT i FROM g"
        )
        request_id = "printf('r%010d', i)"
    return (
        "INSERT INTO usage (request_id, ts, tenant_id, key_id, model, prompt_tokens, "
        "cached_tokens, completion_tokens, status, cost_micro_usd, price_version, replica) "
        f"SELECT {request_id}, ts, 'tn_' || t, 'key_' || t || '_' || (r % 3), "
        "'model_' || (r / 3 % 2), p, CASE WHEN r % 10 = 0 THEN NULL ELSE p / 2 END, r % 500, "
        "CASE WHEN r % 50 = 0 THEN 502 ELSE 200 END, p + 2 * (r % 500), 'pv_bench', "
        "'http://replica-' || (r / 6 % 2) || ':8000' "
        f"FROM (SELECT i, {start} + i * {step!r} AS ts, r % {tenants} AS t, r, "
        f"100 + r % 2000 AS p FROM (SELECT i, {SCRAMBLE} AS r FROM ({rows}) AS n) AS x) AS y"
    )


def _keys_sql(pg: bool, count: int, tenants: int) -> list[str]:
    """`count` API keys spread over the tenants (unique 32-byte hashes), and the tenants."""
    if pg:
        series = f"generate_series(0, {count - 1}) AS g(i)"
        digest = "decode(md5(i::text) || md5((-i - 1)::text), 'hex')"
        tenant_rows = f"generate_series(0, {tenants - 1}) AS g(i)"
        return [
            "INSERT INTO tenants (id, name, created_at) "
            f"SELECT 'tn_' || i, 'tenant-' || i, 0 FROM {tenant_rows}",
            "INSERT INTO api_keys (id, tenant_id, key_hash, created_at) SELECT "
            f"'key_' || lpad(i::text, 8, '0'), 'tn_' || (i % {tenants}), {digest}, i FROM {series}",
        ]

    def recursive(n: int) -> str:
        return f"WITH RECURSIVE g(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM g WHERE i < {n - 1})"

    return [
        f"{recursive(tenants)} INSERT INTO tenants (id, name, created_at) "
        "SELECT 'tn_' || i, 'tenant-' || i, 0 FROM g",
        f"{recursive(count)} INSERT INTO api_keys (id, tenant_id, key_hash, created_at) "
        f"SELECT printf('key_%08d', i), 'tn_' || (i % {tenants}), randomblob(32), i FROM g",
    ]


def _tune_for_load(db: Database) -> None:
    """Settings of this throwaway store's loading connection only: what the rows and
    rollups are does not depend on them, only how much the load waits on the disk."""
    if db.backend == "sqlite":
        for pragma in ("synchronous=OFF", f"cache_size=-{FILL_CACHE_KIB}", "temp_store=MEMORY"):
            db.execute(f"PRAGMA {pragma}")
    else:  # the backfill's sorts and hashes in memory
        db.execute(f"SET work_mem = '{FILL_CACHE_KIB}kB'")
        db.execute(f"SET maintenance_work_mem = '{FILL_CACHE_KIB}kB'")


def fill(db: Database, rows: int, keys: int, tenants: int, end: int) -> float:
    """Write the keys and the ledger, then the rollups; seconds taken.

    The insert trigger is off for the load and the rollups summed once after by the
    migration's own backfill statements (schema.rollup_backfill), which sum the ledger
    as the triggers do: a trigger per row (SQLite) or per 250,000-row statement
    (PostgreSQL) made filling 10M rows take most of an hour. benchmarks/tests checks the
    rollups so filled equal the ledger (reconcile)."""
    pg = db.backend != "sqlite"

    def execute(sql: str) -> None:
        # psycopg reads % as a placeholder (the statements take no parameters).
        db.execute(sql.replace("%", "%%") if pg else sql)

    started = time.monotonic()
    _tune_for_load(db)
    with db.transaction():
        for sql in _keys_sql(pg, keys, tenants):
            execute(sql)
    start = end - DAYS * DAY
    step = DAYS * DAY / rows
    if pg:
        db.execute(f"ALTER TABLE usage DISABLE TRIGGER {SQLITE_ROLLUP_TRIGGER}")
    else:
        db.execute(f"DROP TRIGGER {SQLITE_ROLLUP_TRIGGER}")
    for first in range(0, rows, CHUNK):
        with db.transaction():
            chunk = _ledger_chunk(
                pg, first, min(CHUNK, rows - first), start=start, step=step, tenants=tenants
            )
            execute(chunk)
        print(f"  {min(first + CHUNK, rows):,} rows", end="\r", flush=True)
    with db.transaction():
        for sql in rollup_backfill(pg):
            db.execute(sql)
        if pg:
            db.execute(f"ALTER TABLE usage ENABLE TRIGGER {SQLITE_ROLLUP_TRIGGER}")
        else:
            db.execute(sqlite_rollup_trigger())
    db.execute("VACUUM ANALYZE" if pg else "ANALYZE")
    if not pg:  # a gateway's WAL is checkpointed as it goes: read the database, not a log
        db.query("PRAGMA wal_checkpoint(TRUNCATE)")  # of every page the load wrote
    return time.monotonic() - started


async def _series(reader: UsageReader, query: dict[str, str], tenant: str | None) -> list[Any]:
    """Every page of a usage query (what a chart of the range reads)."""
    buckets: list[Any] = []
    while True:
        status, page = await usage_completions(reader, query, tenant)
        assert status == 200, page
        buckets += page["data"]
        if not page["has_more"]:
            return buckets
        query = {**query, "page": page["next_page"]}


async def measure(
    reader: UsageReader,
    keys_after: Callable[[str], Awaitable[list[Any]]],
    args: argparse.Namespace,
    end: int,
    runs: int,
) -> tuple[Timings, Timings]:
    """`runs` timings (wall clock, and CPU) of each query: random tenants, key positions."""
    rng = random.Random(1)
    times: Timings = {name: [] for name in TARGETS_MS}
    # This process's CPU (the SQLite reader thread's included; not PostgreSQL's server):
    # on a busy machine, what the work costs apart from waiting for a CPU.
    cpu: Timings = {name: [] for name in TARGETS_MS}
    for _ in range(runs):
        tenant = f"tn_{rng.randrange(args.tenants)}"
        t0, c0 = time.perf_counter(), time.process_time()
        hourly = await _series(
            reader,
            {
                "start_time": str(end - 30 * DAY),
                "end_time": str(end),
                "bucket_width": "1h",
                "limit": "168",  # the most a page holds: 5 pages, as a chart reads them
            },
            tenant,
        )
        times["tenant 30-day hourly"].append(time.perf_counter() - t0)
        cpu["tenant 30-day hourly"].append(time.process_time() - c0)
        assert len(hourly) == 30 * 24
        t0, c0 = time.perf_counter(), time.process_time()
        daily = await _series(
            reader,
            {
                "start_time": str(end - DAYS * DAY),
                "end_time": str(end),
                "bucket_width": "1d",
                "group_by": "tenant",
                "limit": "31",
                "top": str(TOP_N),
            },
            None,
        )
        times["all tenants 90-day daily top-N"].append(time.perf_counter() - t0)
        cpu["all tenants 90-day daily top-N"].append(time.process_time() - c0)
        assert len(daily) == DAYS
        assert len({r["tenant_id"] for b in daily for r in b["results"]}) == TOP_N
        t0, c0 = time.perf_counter(), time.process_time()
        page = await keys_after(f"key_{rng.randrange(args.keys - KEYS_PAGE):08d}")
        times["key list page"].append(time.perf_counter() - t0)
        cpu["key list page"].append(time.process_time() - c0)
        assert len(page) == KEYS_PAGE
    return times, cpu


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=10_000_000, help="ledger rows (default 10M)")
    parser.add_argument(
        "--store",
        choices=("sqlite", "postgres"),
        default="sqlite",
        help="the backend (postgres: a server of its own)",
    )
    parser.add_argument("--keys", type=int, default=1_000_000, help="API keys (default 1M)")
    parser.add_argument("--tenants", type=int, default=1000, help="tenants the rows spread over")
    parser.add_argument("--runs", type=int, default=30, help="measurements of each query")


def run(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="saltgate-usage-bench-"))
    server: PostgresServer | None = None
    try:
        if args.store == "postgres":
            server = PostgresServer(fsync=False)
            server.start()
            with server.connect() as conn:  # fewer checkpoints while the rows go in
                conn.execute("ALTER SYSTEM SET max_wal_size = '16GB'")
                conn.execute("SELECT pg_reload_conf()")
            server.create_database("usage_bench")
            settings = server.settings("usage_bench", work / "spool")
        else:
            settings = StoreSettings.in_state_dir(work)
        return _run(args, settings)
    finally:
        if server is not None:
            server.destroy()
        shutil.rmtree(work, ignore_errors=True)


def _measure_store(
    settings: StoreSettings, args: argparse.Namespace, end: int
) -> tuple[Timings, Timings]:
    """`measure` on a store already filled (after two warm-up runs)."""

    async def go() -> tuple[Timings, Timings]:
        reader = open_usage_reader(settings)

        async def keys_after(cursor: str) -> list[Any]:
            return await reader.query(
                "SELECT id, tenant_id, created_at, revoked_at FROM api_keys WHERE id > ? "
                "ORDER BY id LIMIT ?",
                (cursor, KEYS_PAGE),
            )

        try:
            await measure(reader, keys_after, args, end, 2)  # warm the caches
            return await measure(reader, keys_after, args, end, args.runs)
        finally:
            await reader.aclose()

    return asyncio.run(go())


def _run(args: argparse.Namespace, settings: StoreSettings) -> int:
    end = int(time.time()) // DAY * DAY
    db = open_database(settings)
    try:
        seconds = fill(db, args.rows, args.keys, args.tenants, end)
        [(rollup_rows,)] = db.query("SELECT count(*) FROM usage_rollup_1h")
    finally:
        db.close()
    print(
        f"filled {args.rows:,} ledger rows and {args.keys:,} keys in {seconds:.0f} s "
        f"({rollup_rows:,} hourly rollup rows)"
    )

    # Measured in a process of its own, as a gateway reads a store it did not load: in the
    # process that had just filled 10M rows, the hourly series took 2-4x as long, its own
    # CPU included (docs/benchmarks.md, "Usage queries"; the cause was not found).
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as apart:
        times, cpu = apart.submit(_measure_store, settings, args, end).result()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"load average (1, 5, 15 min) at the end: {load} on {os.cpu_count()} CPUs")
    failed = False
    for name, target in TARGETS_MS.items():
        got = p95(times[name]) * 1000
        failed |= got > target
        print(
            f"{name:32} p95 {got:8.1f} ms  (target <= {target:.0f} ms, {args.store}); "
            f"CPU here p95 {p95(cpu[name]) * 1000:.1f} ms"
        )
    return 1 if failed else 0
