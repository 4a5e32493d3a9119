"""Opening a store from its `[store]` settings: the CLI's database, a gateway's keys and ledger.

psycopg is imported only when a PostgreSQL store is opened, so the embedded default
(`saltgate up`, SQLite) never loads it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from saltgate.prices import PriceVersion
from saltgate.store.audit import audit_key
from saltgate.store.db import Database
from saltgate.store.errors import StoreError
from saltgate.store.ledger import Ledger, UsageLedger
from saltgate.store.settings import StoreSettings
from saltgate.store.sqlite import SqliteDatabase
from saltgate.store.tenants import KeyIndex, KeySource


def open_database(settings: StoreSettings, *, create: bool = True) -> Database:
    """The store for admin commands; with ``create=False`` a missing SQLite file is an
    error instead of a new empty database (a report should not invent one)."""
    if settings.backend == "sqlite":
        assert settings.sqlite_path is not None
        if not create and not settings.sqlite_path.exists():
            raise StoreError(
                f"no saltgate database at {settings.sqlite_path} (wrong --state-dir or --config?)"
            )
        return SqliteDatabase(settings.sqlite_path, audit_key(settings.master_key_file))
    from saltgate.store.postgres import PostgresDatabase

    return PostgresDatabase(settings, audit_key(settings.master_key_file))


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
) -> GatewayStore:
    """Keys and ledger, migrated and loaded; StoreError if the store cannot be used.

    `busy` (SQLite) lets a ledger commit wait a moment for records about to arrive;
    `outage_grace_s` (PostgreSQL) is how long authentication goes on without the store;
    `prices` are the versions the gateway bills with, kept in the store's `prices` table.
    """
    if settings.backend == "sqlite":
        assert settings.sqlite_path is not None
        keys = KeyIndex(settings.sqlite_path)
        return GatewayStore(keys, Ledger(settings.sqlite_path, busy=busy, prices=prices))

    from saltgate.store.pg_ledger import PgLedger
    from saltgate.store.postgres import PgKeyIndex, PostgresDatabase

    # Migrate once, from a plain connection, before the keys and the ledger use the schema.
    await asyncio.to_thread(lambda: PostgresDatabase(settings).close())
    pg_keys = PgKeyIndex(settings, outage_grace_s=outage_grace_s)
    await pg_keys.start()
    ledger = PgLedger(settings, prices=prices)
    await ledger.start()
    return GatewayStore(
        pg_keys, ledger, unreachable_for=pg_keys.down_for, spooled=lambda: ledger.spooled
    )
