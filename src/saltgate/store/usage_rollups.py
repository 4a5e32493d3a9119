"""Reading the usage rollups (schema version 9), on either backend, without the ledger.

The rollups are written by triggers in the ledger's own transactions (store/schema.py,
`ROLLUPS`), so here is only reading: `read_buckets` sums one rollup table into buckets of
the width asked for, grouped as asked (and kept to the groups `rank_groups` found
largest, for `top`); `reconcile` checks every rollup table against the
ledger, to the token. Reads go through a `UsageReader` of their own (a connection that is
not the ledger's), so a query never waits on or holds up a ledger commit.
"""

# ruff: noqa: S608 - SQL is built from the schema's own names; values are bound parameters

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from saltgate.store.schema import ROLLUP_DIMS, ROLLUP_SUMS, ROLLUPS, rollup_select
from saltgate.store.settings import Backend, StoreSettings
from saltgate.store.sqlite import open_db

SUMS = tuple(name for name, _ in ROLLUP_SUMS)


class UsageReader(Protocol):
    """Runs one read-only statement (``?`` placeholders) off the event loop."""

    backend: Backend

    async def query(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]: ...

    async def aclose(self) -> None: ...


class SqliteUsageReader:
    """One connection of its own, used from one thread (WAL: it never blocks the ledger)."""

    backend: Backend = "sqlite"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="saltgate-usage")
        self._conn: sqlite3.Connection | None = None

    def _run(self, sql: str, params: Sequence[object]) -> list[tuple[Any, ...]]:
        if self._conn is None:
            self._conn = open_db(self.path)
        return self._conn.execute(sql, params).fetchall()

    async def query(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self._run, sql, params)

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._thread, self._close)
        self._thread.shutdown()


class PostgresUsageReader:
    """A small pool of its own (psycopg is imported only for a PostgreSQL store)."""

    backend: Backend = "postgresql"

    def __init__(self, settings: StoreSettings) -> None:
        from psycopg_pool import AsyncConnectionPool  # noqa: PLC0415 - only for PostgreSQL

        from saltgate.store.postgres import conninfo  # noqa: PLC0415 - imports psycopg

        self._pool: Any = AsyncConnectionPool(
            conninfo(settings),
            min_size=0,
            max_size=2,
            kwargs={"autocommit": True},
            open=False,
            name="saltgate-usage",
        )
        self._opened = False

    async def query(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        if not self._opened:
            await self._pool.open()
            self._opened = True
        async with self._pool.connection() as conn:
            cursor = await conn.execute(sql.replace("?", "%s"), params)
            rows: list[tuple[Any, ...]] = await cursor.fetchall()
            return rows

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self._pool.close()


def open_usage_reader(settings: StoreSettings) -> UsageReader:
    if settings.backend == "sqlite":
        assert settings.sqlite_path is not None
        return SqliteUsageReader(settings.sqlite_path)
    return PostgresUsageReader(settings)


class Group(NamedTuple):
    """One bucket's sums for one group; a dimension not grouped by is None. A tuple: a
    chart's page builds hundreds, and a frozen dataclass costs more to build."""

    bucket: int
    dims: Mapping[str, str | None]
    sums: Mapping[str, int]


def choose_rollup(width: int, needed: frozenset[str]) -> tuple[str, int]:
    """The first (coarsest, narrowest) rollup table that can answer buckets of `width`
    seconds using the dimensions `needed` (grouped by or filtered on)."""
    for table, table_width, dims in ROLLUPS:
        if width % table_width == 0 and needed <= set(dims):
            return table, table_width
    raise ValueError(f"no rollup for buckets of {width} s over {sorted(needed)}")


@dataclass(frozen=True, slots=True)
class Top:
    """Rank the groups by `rank` (a sum of these rollup columns) over [start, end), which
    may be wider than the buckets read (a whole series of pages), and keep the `n` largest."""

    n: int
    rank: tuple[str, ...]
    start: int
    end: int


def _filtered(
    reader: UsageReader, table: str, filters: Mapping[str, Sequence[str]]
) -> tuple[str, list[str], list[object]] | None:
    """The table to read (by its tenant index when filtered by tenant), the WHERE clauses
    of `filters` and their values; None when a filter keeps nothing."""
    where: list[str] = []
    params: list[object] = []
    for dim in ROLLUP_DIMS:  # a fixed order: the same query text for the same question
        if dim in filters:
            wanted = filters[dim]
            if not wanted:
                return None
            where.append(f"{dim} IN ({', '.join('?' * len(wanted))})")
            params += wanted
    # A tenant's rows by its index: with the statistics of a large table SQLite would
    # rather scan the bucket range of every tenant (PostgreSQL picks the index itself).
    source = table
    if reader.backend == "sqlite" and "tenant_id" in filters:
        source = f"{table} INDEXED BY {table}_tenant"
    return source, where, params


async def rank_groups(
    reader: UsageReader,
    width: int,
    *,
    group_by: Sequence[str],
    filters: Mapping[str, Sequence[str]],
    top: Top,
) -> tuple[tuple[str, ...], ...]:
    """The `top.n` largest groups over [top.start, top.end), largest first (ties in key
    order): their dimensions' values as stored (in ROLLUP_DIMS order; a replica unnamed
    is ''), for `read_buckets(groups=...)`. Ranked once for a whole series of pages, so
    every page lists the same groups, however much usage arrives meanwhile."""
    table, _ = choose_rollup(width, frozenset(group_by) | frozenset(filters))
    filtered = _filtered(reader, table, filters)
    dims = [d for d in ROLLUP_DIMS if d in group_by]
    if filtered is None or not dims:
        return ()
    source, where, params = filtered
    key = ", ".join(dims)
    rank = " + ".join(f"sum({c})" for c in top.rank)
    rows = await reader.query(
        f"SELECT {key} FROM {source} "
        f"WHERE {' AND '.join(['bucket >= ?', 'bucket < ?', *where])} "
        f"GROUP BY {key} ORDER BY {rank} DESC, {key} LIMIT {int(top.n)}",
        [top.start, top.end, *params],
    )
    return tuple(tuple(row) for row in rows)


async def read_buckets(
    reader: UsageReader,
    width: int,
    start: int,
    end: int,
    *,
    group_by: Sequence[str],
    filters: Mapping[str, Sequence[str]],
    groups: Sequence[Sequence[str]] | None = None,
) -> list[Group]:
    """Sums per bucket (start aligned to `width`, in [start, end)) and group, in order.

    `filters` keeps only rows whose dimension is one of the values (an empty list: none);
    `groups` (None: all) only these groups, each its grouped dimensions' stored values in
    ROLLUP_DIMS order (what `rank_groups` answers).
    """
    table, table_width = choose_rollup(width, frozenset(group_by) | frozenset(filters))
    filtered = _filtered(reader, table, filters)
    if filtered is None or (groups is not None and not groups):
        return []
    source, where, params = filtered
    dims = [d for d in ROLLUP_DIMS if d in group_by]
    if groups is not None:
        # One dimension: `model IN (?, ?)`; several: row values (both backends take them).
        if len(dims) == 1:
            where.append(f"{dims[0]} IN ({', '.join('?' * len(groups))})")
        else:
            one = f"({', '.join('?' * len(dims))})"
            where.append(f"({', '.join(dims)}) IN (VALUES {', '.join([one] * len(groups))})")
        params += [value for group in groups for value in group]
    # Buckets of the table's own width are its rows' buckets: grouped in key order, unsorted.
    bucket = "bucket" if width == table_width else f"bucket / {width} * {width}"
    columns = ", ".join((bucket, *dims, *(f"CAST(sum({s}) AS BIGINT)" for s in SUMS)))
    order = ", ".join(str(i) for i in range(1, len(dims) + 2))
    sql = (
        f"SELECT {columns} FROM {source} "
        f"WHERE {' AND '.join(['bucket >= ?', 'bucket < ?', *where])} "
        f"GROUP BY {order} ORDER BY {order}"
    )
    found = []
    sums_at = 1 + len(dims)
    for row in await reader.query(sql, [start, end, *params]):
        named: dict[str, str | None] = dict.fromkeys(ROLLUP_DIMS)
        named.update(zip(dims, row[1:sums_at], strict=True))
        if named["replica"] == "":
            named["replica"] = None  # rows from before the ledger named replicas
        found.append(
            Group(int(row[0]), named, dict(zip(SUMS, map(int, row[sums_at:]), strict=True)))
        )
    return found


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A rollup table that disagrees with the ledger: how many of its rows differ."""

    table: str
    rows_only_in_ledger: int
    rows_only_in_rollup: int


async def reconcile(
    reader: UsageReader, tenant_id: str | None = None
) -> tuple[dict[str, int], list[Mismatch]]:
    """The ledger's totals, and every rollup table that is not the ledger summed exactly
    (compared row by row: each bucket and group, each sum, to the token)."""
    where, params = ("WHERE tenant_id = ?", [tenant_id]) if tenant_id is not None else ("", [])
    mismatches = []
    for table, width, dims in ROLLUPS:
        ledger = rollup_select(width, dims, f"usage {where}", reader.backend != "sqlite")
        rollup = f"SELECT bucket, {', '.join(dims)}, {', '.join(SUMS)} FROM {table} {where}"
        counts = await reader.query(
            f"SELECT (SELECT count(*) FROM ({ledger} EXCEPT {rollup}) a), "
            f"(SELECT count(*) FROM ({rollup} EXCEPT {ledger}) b)",
            params * 4,
        )
        only_ledger, only_rollup = counts[0]
        if only_ledger or only_rollup:
            mismatches.append(Mismatch(table, int(only_ledger), int(only_rollup)))
    sums = ", ".join(
        f"CAST(coalesce(sum({expr.format(r='')}), 0) AS BIGINT)" for _, expr in ROLLUP_SUMS
    )
    [totals] = await reader.query(f"SELECT {sums} FROM usage {where}", params)
    return dict(zip(SUMS, map(int, totals), strict=True)), mismatches
