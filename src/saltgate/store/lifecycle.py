"""Moving a store and trimming its ledger: `saltgate store copy`, `saltgate usage prune`.

A copy moves what a store holds of its own (tenants, hashed API keys, prices: the
versions billed and those set through the store, the usage ledger, hashed admin tokens,
the audit log with its hash chain) as it is: a key is stored as its SHA-256
(saltgate.store.tenants), so the hashes move and every key keeps working, and tenant ids
and epochs move, so every tenant keeps its cache namespace. What each store
keeps for itself (`meta`, `schema_version`) is not copied: a new destination is created at
the current schema when it is opened (an existing one must be at it, as the source must:
`saltgate store migrate`), and its own triggers count its auth generation.
docs/upgrading.md says how to switch a fleet.

Pruning deletes old usage rows. On SQLite a writer holds the one write lock, and a
gateway's ledger commits on its event loop: the delete goes in small batches with a pause
between them, so a gateway waits for one batch at most. On PostgreSQL a delete blocks no
insert, and one statement does it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from saltgate.store.audit import INSERT_ENTRY, SELECT_ENTRIES
from saltgate.store.db import Database
from saltgate.store.errors import StoreError
from saltgate.store.ledger import KEY_USE_UPSERT, PRICE_INSERT, USAGE_INSERT, UsageRecord
from saltgate.store.model_prices import MODEL_PRICES_SQL
from saltgate.store.model_prices import UPSERT as MODEL_PRICE_UPSERT
from saltgate.store.schema import ROLLUPS

# Tenants and keys are upserted by id: a second pass (--since) brings a salt rotation or a
# revocation made in the source since the first, and never undoes one made in either; a
# tenant's models, limits and weight and a key's limits and priority band are the source's.
_TENANT_UPSERT = (
    "INSERT INTO tenants "
    "(id, name, epoch, created_at, allowed_models, limits, archived_at, weight) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
    "epoch = CASE WHEN excluded.epoch > tenants.epoch THEN excluded.epoch ELSE tenants.epoch END, "
    "allowed_models = excluded.allowed_models, limits = excluded.limits, "
    "weight = excluded.weight, "
    "name = excluded.name, archived_at = COALESCE(tenants.archived_at, excluded.archived_at)"
)
_KEY_UPSERT = (
    "INSERT INTO api_keys "
    "(id, tenant_id, key_hash, created_at, revoked_at, limits, priority, expires_at) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
    "revoked_at = COALESCE(api_keys.revoked_at, excluded.revoked_at), limits = excluded.limits, "
    "priority = excluded.priority, expires_at = excluded.expires_at"
)
_ADMIN_TOKEN_COLUMNS = (
    "id, token_hash, scopes, tenant_id, created_at, created_by, last_used_at, revoked_at"  # noqa: S105
)
_ADMIN_TOKEN_UPSERT = (
    f"INSERT INTO admin_tokens ({_ADMIN_TOKEN_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "  # noqa: S608
    "ON CONFLICT (id) DO UPDATE SET last_used_at = excluded.last_used_at, "
    "revoked_at = COALESCE(admin_tokens.revoked_at, excluded.revoked_at)"
)
# The small tables, copied whole on every pass: (query, statement), keys after tenants.
_SMALL_TABLES = (
    (
        "SELECT id, name, epoch, created_at, allowed_models, limits, archived_at, weight "
        "FROM tenants",
        _TENANT_UPSERT,
    ),
    (
        "SELECT id, tenant_id, key_hash, created_at, revoked_at, limits, priority, expires_at "
        "FROM api_keys",
        _KEY_UPSERT,
    ),
    (
        "SELECT version, model, input_micro_usd_per_mtok, cached_input_micro_usd_per_mtok, "
        "output_micro_usd_per_mtok, effective_from FROM prices",
        PRICE_INSERT,
    ),
    # The source's price per model wins; one cleared in the source since a first pass
    # stays in the destination (clear it there, `saltgate prices clear`).
    (MODEL_PRICES_SQL, MODEL_PRICE_UPSERT),
    (f"SELECT {_ADMIN_TOKEN_COLUMNS} FROM admin_tokens", _ADMIN_TOKEN_UPSERT),  # noqa: S608
    ("SELECT key_id, ts FROM key_last_used", KEY_USE_UPSERT),
    # Entries move as they are (their hashes cover their seq); a second pass adds the new.
    (SELECT_ENTRIES + " ORDER BY seq", INSERT_ENTRY + " ON CONFLICT (seq) DO NOTHING"),
    # Who owns each response the replicas keep ([responses] store): continuations keep
    # working against the copy.
    (
        "SELECT id, tenant_id, replica, created_at FROM responses",
        "INSERT INTO responses (id, tenant_id, replica, created_at) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (id) DO NOTHING",
    ),
)
# What a copy moves, in the order it moves them (keys name their tenant).
COPIED_TABLES = (
    "tenants",
    "api_keys",
    "prices",
    "model_prices",
    "admin_tokens",
    "audit_log",
    "key_last_used",
    "responses",
    "usage",
)
# What every store keeps for itself; tests/store/test_lifecycle.py checks that the schema
# has no table outside these two lists. The usage rollups are the destination's own: its
# triggers build them from the usage rows copied.
OWN_TABLES = ("meta", "schema_version", *(table for table, _, _ in ROLLUPS))
# A full copy goes to a store without any of these.
_MUST_BE_EMPTY = ("tenants", "api_keys", "usage")
# SQLite rows from before schema version 3 have no request id; PostgreSQL requires one,
# and a second pass needs it to skip what the first copied: one derived from the row id.
LEGACY_REQUEST_ID = "legacy-{}"
COPY_PAGE_ROWS = 5000
# SQLite prune: rows per transaction, and the pause after each (at least this long, and
# as long as the batch held the lock), in which a gateway's waiting commit gets through.
PRUNE_BATCH_ROWS = 1000
PRUNE_MIN_PAUSE_S = 0.005


@dataclass(frozen=True, slots=True)
class TableCount:
    """One table's rows in the source (as copied) and in the destination afterwards."""

    table: str
    source: int
    destination: int


@dataclass(frozen=True, slots=True)
class CopyResult:
    counts: tuple[TableCount, ...]
    since: float | None
    started_at: float
    source_gained: int  # usage rows committed to the source while it was being copied


def copy_store(
    source: Database, destination: Database, *, since: float | None = None
) -> CopyResult:
    """Copy `source` into `destination` (both migrated) in one destination transaction.

    Without `since` the destination must hold no tenant, key or usage row. With it, only
    usage rows with ``ts >= since`` are read (tenants, keys and prices are small: all
    of them); rows already there (same request id) are skipped, so passes may overlap.
    Afterwards the destination is counted again: StoreError if it holds fewer rows than
    were copied.
    """
    started_at = time.time()
    with source.read_snapshot():
        counted = _counts(source, since)
        with destination.transaction():
            if since is None:
                _refuse_if_not_empty(destination)
            for query, statement in _SMALL_TABLES:
                destination.execute_many(statement, source.query(query))
            for page in _usage_pages(source, since):
                destination.execute_many(USAGE_INSERT, page)
    after = _counts(destination, since)
    counts = tuple(TableCount(t, counted[t], after[t]) for t in COPIED_TABLES)
    short = [c for c in counts if c.destination < c.source]
    if short:
        raise StoreError(
            "verification failed: the destination holds fewer rows than were copied ("
            + ", ".join(f"{c.table}: {c.destination} < {c.source}" for c in short)
            + ")"
        )
    gained = _counts(source, since)["usage"] - counted["usage"]
    return CopyResult(counts, since, started_at, gained)


def _counts(db: Database, since: float | None) -> dict[str, int]:
    counts = {t: _count_rows(db, t) for t in COPIED_TABLES}
    if since is not None:
        counts["usage"] = _count(db, "SELECT count(*) FROM usage WHERE ts >= ?", (since,))
    return counts


def _count_rows(db: Database, table: str) -> int:
    """All rows of one of this module's tables (a name from its constants, never input)."""
    return _count(db, f"SELECT count(*) FROM {table}")  # noqa: S608


def _count(db: Database, sql: str, params: tuple[object, ...] = ()) -> int:
    [(n,)] = db.query(sql, params)
    return int(n)


def _refuse_if_not_empty(db: Database) -> None:
    held = {t: _count_rows(db, t) for t in _MUST_BE_EMPTY}
    if any(held.values()):
        raise StoreError(
            f"the destination {db.describe()} is not empty ("
            + ", ".join(f"{n} {t}" for t, n in held.items())
            + "): a copy goes to a new, empty store. To add what the source gained since an "
            "earlier copy into this one, give --since (rows already there are skipped)"
        )


def _usage_pages(db: Database, since: float | None) -> Iterator[list[tuple[object, ...]]]:
    """The usage rows as UsageRecord tuples, in pages read by key (each page one query)."""
    sqlite = db.backend == "sqlite"
    key = "id" if sqlite else "request_id"
    where = f"{key} > ?" + ("" if since is None else " AND ts >= ?")
    sql = (
        f"SELECT {key}, {', '.join(UsageRecord._fields)} FROM usage WHERE {where} "  # noqa: S608
        f"ORDER BY {key} LIMIT {COPY_PAGE_ROWS}"
    )
    last: object = -1 if sqlite else ""
    while rows := db.query(sql, (last,) if since is None else (last, since)):
        last = rows[-1][0]
        yield [
            (LEGACY_REQUEST_ID.format(row[0]) if row[1] is None else row[1], *row[2:])
            for row in rows
        ]


def count_usage_before(db: Database, before: float) -> int:
    """How many usage rows `prune_usage(db, before)` would delete."""
    return _count(db, "SELECT count(*) FROM usage WHERE ts < ?", (before,))


@dataclass(frozen=True, slots=True)
class PruneResult:
    deleted: int
    seconds: float
    held_s: tuple[float, ...]  # each transaction's hold of the write lock (SQLite)

    @property
    def longest_transaction_s(self) -> float:
        """The longest a gateway's ledger commit could have waited for the prune."""
        return max(self.held_s, default=0.0)


def prune_usage(db: Database, before: float, *, batch_rows: int = PRUNE_BATCH_ROWS) -> PruneResult:
    """Delete the usage rows with ``ts < before``; see the module docstring for how."""
    start = time.monotonic()
    if db.backend != "sqlite":
        with db.transaction():
            deleted = _count(
                db,
                "WITH d AS (DELETE FROM usage WHERE ts < ? RETURNING 1) SELECT count(*) FROM d",
                (before,),
            )
        elapsed = time.monotonic() - start
        return PruneResult(deleted, elapsed, (elapsed,))
    # The WAL is checkpointed in the pauses (PASSIVE: without the write lock), not by the
    # commit that crosses the threshold, so a batch holds the lock for its rows only.
    db.execute("PRAGMA wal_autocheckpoint=0")
    # Batches by rowid range: each is found without a scan (no index on ts). Finding the
    # range is one scan, a read, which a writer does not wait for (WAL).
    [(low, high)] = db.query("SELECT min(id), max(id) FROM usage WHERE ts < ?", (before,))
    deleted = 0
    held: list[float] = []
    while low is not None and low <= high:
        with db.transaction():
            t0 = time.monotonic()  # BEGIN IMMEDIATE has the lock (after any wait for it)
            deleted += len(
                db.query(
                    "DELETE FROM usage WHERE id >= ? AND id < ? AND ts < ? RETURNING 1",
                    (low, min(low + batch_rows, high + 1), before),
                )
            )
        held.append(time.monotonic() - t0)
        low += batch_rows
        pause_until = time.monotonic() + max(held[-1], PRUNE_MIN_PAUSE_S)
        db.query("PRAGMA wal_checkpoint(PASSIVE)")
        time.sleep(max(0.0, pause_until - time.monotonic()))
    return PruneResult(deleted, time.monotonic() - start, tuple(held))
