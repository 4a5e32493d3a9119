"""Usage records to write and the rows a ledger kept, for the SQLite and PostgreSQL tests."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from saltgate.store.ledger import UsageRecord
from saltgate.store.postgres import PostgresDatabase
from saltgate.store.settings import StoreSettings

USAGE_COLUMNS = (
    "request_id, ts, tenant_id, key_id, model, prompt_tokens, cached_tokens, "
    "completion_tokens, status, cost_micro_usd, price_version, replica"
)
_ROWS = f"SELECT {USAGE_COLUMNS} FROM usage ORDER BY ts"


def usage_record(i: int, tenant: str = "tn_a", model: str = "m") -> UsageRecord:
    """The i-th of a series of distinct records, one second apart."""
    return UsageRecord(
        f"req-{i:08d}", 1_700_000_000.0 + i, tenant, f"key_{i}", model, 100 + i, i, 7, 200
    )


def sqlite_rows(path: Path) -> list[tuple[object, ...]]:
    """Every usage row of the SQLite ledger at ``path``, oldest first."""
    conn = sqlite3.connect(path)
    try:
        return conn.execute(_ROWS).fetchall()
    finally:
        conn.close()


def postgres_rows(settings: StoreSettings) -> list[tuple[object, ...]]:
    """Every usage row of the PostgreSQL ledger, oldest first."""
    db = PostgresDatabase(settings)
    try:
        return db.query(_ROWS)
    finally:
        db.close()
