"""Opening a store from its `[store]` settings: the CLI's database, a gateway's keys and ledger.

psycopg is imported only when a PostgreSQL store is opened, so the embedded default
(`saltgate up`, SQLite) never loads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from saltgate.prices import PriceBook, PriceVersion
from saltgate.store.audit import audit_key
from saltgate.store.db import Database
from saltgate.store.errors import SchemaVersionError, StoreError
from saltgate.store.ledger import Ledger, UsageLedger
from saltgate.store.schema import (
    POSTGRES_MIGRATIONS,
    SCHEMA_VERSION,
    SQLITE_MIGRATIONS,
    migration_steps,
    newer_schema_message,
    older_schema_message,
)
from saltgate.store.settings import StoreSettings
from saltgate.store.sqlite import SqliteDatabase
from saltgate.store.sqlite import read_schema_version as read_sqlite_version
from saltgate.store.tenants import KeyIndex, KeySource


def open_database(
    settings: StoreSettings, *, create: bool = True, upgrade: bool = False
) -> Database:
    """The store for admin commands; with ``create=False`` a missing SQLite file is an
    error instead of a new empty database (a report should not invent one). A store at
    an older schema version is refused (SchemaVersionError) unless `upgrade`: only
    `saltgate store migrate` migrates (migrate_store)."""
    if settings.backend == "sqlite":
        if not create:
            _existing_sqlite(settings)
        assert settings.sqlite_path is not None
        return SqliteDatabase(
            settings.sqlite_path, audit_key(settings.master_key_file), upgrade=upgrade
        )
    from saltgate.store.postgres import PostgresDatabase

    return PostgresDatabase(settings, audit_key(settings.master_key_file), upgrade=upgrade)


def _existing_sqlite(settings: StoreSettings) -> Path:
    assert settings.sqlite_path is not None
    if not settings.sqlite_path.exists():
        raise StoreError(
            f"no saltgate database at {settings.sqlite_path} (wrong --state-dir or --config?)"
        )
    return settings.sqlite_path


SchemaState = Literal["current", "pending", "new", "newer"]


@dataclass(frozen=True, slots=True)
class SchemaStatus:
    """Where a store's schema stands against this saltgate's (`saltgate store status`)."""

    backend: str
    store: str  # where it is (never a password)
    version: int  # the store's; 0: no saltgate schema yet
    expected: int = SCHEMA_VERSION
    steps: tuple[str, ...] = ()  # what migrating it does, one line per version

    @property
    def state(self) -> SchemaState:
        if self.version > self.expected:
            return "newer"
        if self.version == self.expected:
            return "current"
        return "new" if self.version == 0 else "pending"


def schema_status(settings: StoreSettings) -> SchemaStatus:
    """The store's schema version and what a migration would do; reads only (a missing
    SQLite file is an error, not a new store)."""
    if settings.backend == "sqlite":
        version = read_sqlite_version(_existing_sqlite(settings))
        migrations = SQLITE_MIGRATIONS
    else:
        from saltgate.store.postgres import read_schema_version

        version = read_schema_version(settings)
        migrations = POSTGRES_MIGRATIONS
    return SchemaStatus(
        settings.backend, settings.describe(), version, steps=migration_steps(migrations, version)
    )


def require_usable(status: SchemaStatus) -> None:
    """SchemaVersionError, with the message a command opening the store would give, if
    this saltgate would refuse the store (`serve --check`)."""
    if status.state == "newer":
        raise SchemaVersionError(newer_schema_message(status.version))
    if status.state == "pending":
        raise SchemaVersionError(older_schema_message(status.store, status.version))


def backup_path(settings: StoreSettings) -> Path:
    """Where `saltgate store migrate` copies a SQLite store before migrating it:
    ``saltgate.db.pre-v11``, the store as it was before version 11."""
    assert settings.sqlite_path is not None
    return settings.sqlite_path.with_name(f"{settings.sqlite_path.name}.pre-v{SCHEMA_VERSION}")


def backup_sqlite(settings: StoreSettings) -> Path:
    """An online copy of the SQLite store (one consistent snapshot, mode 0600) at
    backup_path; StoreError if that file exists (an earlier backup is never overwritten)."""
    path = _existing_sqlite(settings)
    target = backup_path(settings)
    try:
        os.close(os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        raise StoreError(
            f"{target} exists (an earlier backup): move it away, or give --no-backup if "
            "you have your own"
        ) from None
    except OSError as exc:
        raise StoreError(f"cannot create the backup {target}: {exc.strerror}") from None
    try:
        with (
            contextlib.closing(sqlite3.connect(path)) as source,
            contextlib.closing(sqlite3.connect(target)) as copy,
        ):
            source.backup(copy)
    except sqlite3.Error as exc:
        target.unlink(missing_ok=True)
        raise StoreError(f"backing up {path} to {target}: {exc}") from None
    return target


def migrate_store(settings: StoreSettings) -> SchemaStatus:
    """Apply the pending migrations (`saltgate store migrate`), each backend in one
    transaction; a store already current is left as it is. The status before."""
    before = schema_status(settings)
    if before.state == "newer":
        raise SchemaVersionError(newer_schema_message(before.version))
    if before.state != "current":
        open_database(settings, upgrade=True).close()
    return before


# What the gateway's metrics register a gauge with: name, help text, reader.
GaugeReader = Callable[[], list[tuple[tuple[tuple[str, str], ...], float]]]


@dataclass
class GatewayStore:
    """What a running gateway holds of its store."""

    keys: KeySource
    ledger: UsageLedger
    # PostgreSQL: seconds since the key store last answered, records spooled since start.
    unreachable_for: Callable[[], float] = field(default=lambda: 0.0)
    spooled: Callable[[], int] = field(default=lambda: 0)

    def register_gauges(self, gauge: Callable[[str, str, GaugeReader], None]) -> None:
        """Give the admin port's metrics the store's health (`Metrics.gauge`)."""
        gauge(
            "saltgate_store_unreachable_seconds",
            "Seconds since the store last answered (0 while it answers).",
            lambda: [((), self.unreachable_for())],
        )
        gauge(
            "saltgate_ledger_spooled_records",
            "Usage records spooled to local disk since start because the store was down.",
            lambda: [((), float(self.spooled()))],
        )

    async def aclose(self) -> None:
        """Commit what the ledger holds, then let go of the keys."""
        await self.ledger.aclose()
        await self.keys.aclose()


async def open_gateway_store(
    settings: StoreSettings,
    *,
    busy: Callable[[], bool] | None = None,
    outage_grace_s: float = 60.0,
    prices: Iterable[PriceVersion] = (),
    book: PriceBook | None = None,
) -> GatewayStore:
    """Keys and ledger, migrated and loaded; StoreError if the store cannot be used.

    `busy` (SQLite) lets a ledger commit wait a moment for records about to arrive;
    `outage_grace_s` (PostgreSQL) is how long authentication goes on without the store;
    `prices` are the versions the gateway bills with, kept in the store's `prices` table;
    `book` is handed the prices set through the store whenever the keys reload.
    """
    if settings.backend == "sqlite":
        assert settings.sqlite_path is not None
        keys = KeyIndex(settings.sqlite_path, book=book)
        return GatewayStore(keys, Ledger(settings.sqlite_path, busy=busy, prices=prices))

    from saltgate.store.pg_ledger import PgLedger
    from saltgate.store.postgres import PgKeyIndex, PostgresDatabase

    # Migrate once, from a plain connection, before the keys and the ledger use the schema.
    await asyncio.to_thread(lambda: PostgresDatabase(settings).close())
    pg_keys = PgKeyIndex(settings, outage_grace_s=outage_grace_s, book=book)
    await pg_keys.start()
    ledger = PgLedger(settings, prices=prices)
    await ledger.start()
    return GatewayStore(
        pg_keys, ledger, unreachable_for=pg_keys.down_for, spooled=lambda: ledger.spooled
    )
