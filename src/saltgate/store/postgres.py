"""The PostgreSQL backend: connections, migrations, the CLI's database and the gateway's keys.

Every gateway of a fleet shares one database. Changes to tenants, keys and the prices set
through the store reach them all
through LISTEN/NOTIFY: a statement trigger bumps ``meta.auth_generation`` and notifies
channel ``saltgate_auth`` at commit (saltgate.store.schema); each gateway holds one
listening connection and reloads its key snapshot when the generation moved. The same
connection reads the generation every `check_interval_s` while idle, which catches a
notification lost to a reconnect and tells the gateway the database still answers.

When the database stops answering, a gateway keeps authenticating from the snapshot it
has for `outage_grace_s`, then refuses with StoreUnavailableError (a 503) until the
database is back (docs/store.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import psycopg
from psycopg import IsolationLevel
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from saltgate.prices import PriceBook
from saltgate.store.errors import (
    ConflictError,
    SchemaVersionError,
    StoreError,
    StoreUnavailableError,
)
from saltgate.store.model_prices import MODEL_PRICES_SQL, store_versions
from saltgate.store.schema import (
    LISTEN_AUTH_SQL,
    MIGRATION_LOCK_ID,
    POSTGRES_MIGRATIONS,
    POSTGRES_VERSION_TABLE,
    SCHEMA_VERSION,
    newer_schema_message,
    older_schema_message,
    pending,
)
from saltgate.store.settings import Backend, StoreSettings
from saltgate.store.tenants import LIVE_KEYS_SQL, KeySnapshot, Principal

log = logging.getLogger(__name__)

# Used where the URL does not say otherwise: a dead server is noticed in seconds, and
# the database's own view (pg_stat_activity) names the process.
_CONNINFO_DEFAULTS = {
    "application_name": "saltgate",
    "connect_timeout": "3",
    "keepalives": "1",
    "keepalives_idle": "5",
    "keepalives_interval": "2",
    "keepalives_count": "3",
}
# The exceptions that mean "the database did not answer" (as opposed to a bug).
UNREACHABLE = (psycopg.OperationalError, psycopg.InterfaceError, OSError, TimeoutError)


def conninfo(settings: StoreSettings) -> str:
    """The libpq connection string, with the password read now from its file or variable.

    The result holds the password: pass it to the driver, never to a log or a message.
    """
    if settings.backend != "postgresql":
        raise ValueError(f"not a PostgreSQL store: {settings.describe()}")
    params: dict[str, Any] = {
        k: v for k, v in _CONNINFO_DEFAULTS.items() if k not in conninfo_to_dict(settings.url)
    }
    if settings.password_file is not None:
        try:
            params["password"] = settings.password_file.read_text().strip()
        except OSError as exc:
            raise StoreError(
                f"[store] password_file: cannot read {settings.password_file}: {exc.strerror}"
            ) from None
    elif settings.password_env is not None:
        value = os.environ.get(settings.password_env)
        if not value:
            raise StoreError(
                f"[store] password_env: environment variable {settings.password_env} is not set"
            )
        params["password"] = value
    return make_conninfo(settings.url, **params)


def describe_error(exc: BaseException) -> str:
    """libpq's message on one line (it never contains the password)."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def unreachable(settings: StoreSettings, exc: BaseException) -> StoreError:
    return StoreError(f"cannot reach the store {settings.describe()}: {describe_error(exc)}")


def connect_unmigrated(settings: StoreSettings) -> psycopg.Connection[tuple[Any, ...]]:
    """An autocommit connection, the schema as it is (`saltgate store status`)."""
    try:
        return psycopg.connect(conninfo(settings), autocommit=True)
    except psycopg.Error as exc:
        raise unreachable(settings, exc) from None


def connect(
    settings: StoreSettings, *, upgrade: bool = False
) -> psycopg.Connection[tuple[Any, ...]]:
    """An autocommit connection to a store at the current version (for the CLI and for
    startup): a new database is given the schema; an older one is migrated only with
    `upgrade` (`saltgate store migrate`), else refused, as a newer one always is."""
    conn = connect_unmigrated(settings)
    try:
        migrate(conn, upgrade=upgrade, where=settings.describe())
    except psycopg.Error as exc:
        conn.close()
        raise StoreError(f"store {settings.describe()}: {describe_error(exc)}") from None
    except BaseException:
        conn.close()
        raise
    return conn


def schema_version(conn: psycopg.Connection[tuple[Any, ...]]) -> int:
    """The database's version, 0 if it has no saltgate schema yet; changes nothing."""
    row = conn.execute("SELECT to_regclass('schema_version') IS NOT NULL").fetchone()
    if row is None or not row[0]:
        return 0
    row = conn.execute("SELECT max(version) FROM schema_version").fetchone()
    return int(row[0]) if row is not None and row[0] is not None else 0


def read_schema_version(settings: StoreSettings) -> int:
    """The store's schema version (0: none yet), read without changing anything."""
    conn = connect_unmigrated(settings)
    try:
        return schema_version(conn)
    except psycopg.Error as exc:
        raise StoreError(f"store {settings.describe()}: {describe_error(exc)}") from None
    finally:
        conn.close()


def migrate(
    conn: psycopg.Connection[tuple[Any, ...]], *, upgrade: bool = False, where: str = ""
) -> None:
    """Bring the schema to SCHEMA_VERSION in one transaction: a new database always, an
    older one only with `upgrade` (else SchemaVersionError, nothing changed).

    An advisory lock serialises gateways and CLIs that start together; the second one
    finds the work done.
    """
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_ID,))
        version = schema_version(conn)
        if version > SCHEMA_VERSION:
            raise SchemaVersionError(newer_schema_message(version))
        if 0 < version < SCHEMA_VERSION and not upgrade:
            raise SchemaVersionError(older_schema_message(where, version))
        conn.execute(POSTGRES_VERSION_TABLE)
        for m in pending(POSTGRES_MIGRATIONS, version):
            for stmt in m.statements:
                conn.execute(stmt)
            conn.execute(
                "INSERT INTO schema_version (version, name, applied_at) VALUES (%s, %s, %s)",
                (m.version, m.name, time.time()),
            )


class PostgresDatabase:
    """The CLI's view of a PostgreSQL store (`saltgate.store.db.Database`)."""

    backend: Backend = "postgresql"

    def __init__(
        self, settings: StoreSettings, audit_key: bytes | None = None, *, upgrade: bool = False
    ) -> None:
        self.settings = settings
        self.conn = connect(settings, upgrade=upgrade)
        self.audit_key = audit_key

    def describe(self) -> str:
        return self.settings.describe()

    def query(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        with self._errors():
            cur = self.conn.execute(sql.replace("?", "%s"), params)
            return cur.fetchall() if cur.description is not None else []

    def execute(self, sql: str, params: Sequence[object] = ()) -> None:
        self.query(sql, params)

    def execute_many(self, sql: str, rows: Iterable[Sequence[object]]) -> None:
        with self._errors(), self.conn.cursor() as cur:
            cur.executemany(sql.replace("?", "%s"), rows)

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """Driver errors as the store's: a conflict, or a safe message."""
        try:
            yield
        except psycopg.errors.IntegrityError as exc:
            raise ConflictError(describe_error(exc)) from None
        except psycopg.Error as exc:
            raise StoreError(f"store {self.describe()}: {describe_error(exc)}") from None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        try:
            with self.conn.transaction():
                yield
        except psycopg.Error as exc:  # e.g. the commit itself failed
            raise StoreError(f"store {self.describe()}: {describe_error(exc)}") from None

    @contextlib.contextmanager
    def read_snapshot(self) -> Iterator[None]:
        self.conn.isolation_level = IsolationLevel.REPEATABLE_READ
        self.conn.read_only = True
        try:
            with self.transaction():
                yield
        finally:
            self.conn.isolation_level = None
            self.conn.read_only = None

    def close(self) -> None:
        self.conn.close()


class PgKeyIndex:
    """The gateway's snapshot of the live keys in a PostgreSQL store, kept current by
    LISTEN/NOTIFY on one dedicated connection (see the module docstring).

    `authenticate` never waits for the database: a hash, a dict lookup, and while the
    database is out of reach a clock read against the grace period.
    """

    def __init__(
        self,
        settings: StoreSettings,
        *,
        outage_grace_s: float = 60.0,
        check_interval_s: float = 1.0,
        retry_interval_s: float = 0.25,
        query_timeout_s: float = 5.0,
        book: PriceBook | None = None,
    ) -> None:
        """``book``: handed the store's prices at every reload (the gateway's PriceBook)."""
        self.settings = settings
        self._book = book
        self.outage_grace_s = outage_grace_s
        self.check_interval_s = check_interval_s
        self.retry_interval_s = retry_interval_s
        self.query_timeout_s = query_timeout_s
        self._keys = KeySnapshot()
        self._generation: int | None = None
        self._last_ok = time.monotonic()
        self._down_since: float | None = None
        self._task: asyncio.Task[None] | None = None
        self.reloads = 0

    async def start(self) -> None:
        """Load the keys and start listening; StoreError if the database does not answer."""
        try:
            conn = await self._connect_and_load()
        except UNREACHABLE as exc:
            raise unreachable(self.settings, exc) from None
        self._task = asyncio.get_running_loop().create_task(self._run(conn))

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def __len__(self) -> int:
        return len(self._keys)

    def authenticate(self, presented: str) -> Principal | None:
        if self._down_since is not None:
            down_for = time.monotonic() - self._down_since
            if down_for > self.outage_grace_s:
                raise StoreUnavailableError(
                    f"The gateway has not reached its key store for {down_for:.0f} s (it "
                    f"authenticates from the keys it knows for at most "
                    f"{self.outage_grace_s:g} s); try again shortly."
                )
        return self._keys.lookup(presented)

    def down_for(self) -> float:
        """Seconds since the database last answered, 0.0 while it answers."""
        return 0.0 if self._down_since is None else time.monotonic() - self._down_since

    async def _connect_and_load(self) -> psycopg.AsyncConnection[tuple[Any, ...]]:
        conn = await asyncio.wait_for(
            psycopg.AsyncConnection.connect(conninfo(self.settings), autocommit=True),
            self.query_timeout_s,
        )
        try:
            await conn.set_isolation_level(IsolationLevel.REPEATABLE_READ)
            # LISTEN before the load: a change committed in between is then both in the
            # snapshot or notified, never neither.
            await conn.execute(LISTEN_AUTH_SQL)
            await self._reload(conn)
        except BaseException:
            await conn.close()
            raise
        self._reachable()
        return conn

    async def _reload(self, conn: psycopg.AsyncConnection[tuple[Any, ...]]) -> None:
        """Generation, live keys and the store's prices from one snapshot (REPEATABLE
        READ transaction)."""

        async def read() -> tuple[int, list[tuple[Any, ...]], list[tuple[Any, ...]]]:
            async with conn.transaction():
                cur = await conn.execute("SELECT auth_generation FROM meta WHERE id = 1")
                row = await cur.fetchone()
                rows = await (await conn.execute(LIVE_KEYS_SQL)).fetchall()
                prices = await (await conn.execute(MODEL_PRICES_SQL)).fetchall()
            assert row is not None  # migration 3 inserts the one meta row
            return int(row[0]), rows, prices

        generation, rows, prices = await asyncio.wait_for(read(), self.query_timeout_s)
        self._keys = KeySnapshot(rows)
        if self._book is not None:
            self._book.stored(store_versions(prices))
        self._generation = generation
        self.reloads += 1

    async def _run(self, conn: psycopg.AsyncConnection[tuple[Any, ...]] | None) -> None:
        while True:
            try:
                if conn is None:
                    conn = await self._connect_and_load()
                await self._watch(conn)
            except (*UNREACHABLE, psycopg.Error, StoreError) as exc:  # StoreError: password
                self._unreachable(exc)
                if conn is not None:
                    with contextlib.suppress(*UNREACHABLE, psycopg.Error):
                        await conn.close()
                    conn = None
                await asyncio.sleep(self.retry_interval_s)
            except asyncio.CancelledError:
                if conn is not None:
                    with contextlib.suppress(*UNREACHABLE, psycopg.Error):
                        await conn.close()
                raise

    async def _watch(self, conn: psycopg.AsyncConnection[tuple[Any, ...]]) -> None:
        """Wait for a notification (or the check interval), then compare generations."""
        while True:
            async for _ in conn.notifies(timeout=self.check_interval_s, stop_after=1):
                pass
            cur = await asyncio.wait_for(
                conn.execute("SELECT auth_generation FROM meta WHERE id = 1"),
                self.query_timeout_s,
            )
            row = await cur.fetchone()
            if row is not None and int(row[0]) != self._generation:
                await self._reload(conn)
            self._reachable()

    def _reachable(self) -> None:
        self._last_ok = time.monotonic()
        if self._down_since is not None:
            log.warning(
                "key store %s reachable again after %.1f s",
                self.settings.describe(),
                self._last_ok - self._down_since,
            )
            self._down_since = None

    def _unreachable(self, exc: BaseException) -> None:
        if self._down_since is None:
            self._down_since = self._last_ok
            log.warning(
                "key store %s unreachable (%s); authenticating from the %d keys "
                "known for at most %g s",
                self.settings.describe(),
                describe_error(exc),
                len(self._keys),
                self.outage_grace_s,
            )
