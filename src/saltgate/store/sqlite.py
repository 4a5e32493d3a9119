"""The embedded backend: one SQLite file (WAL), opened, migrated and wrapped for the CLI.

The CLI and a running gateway share the file across processes without a server: WAL lets
the gateway's reader and ledger writer run alongside CLI writes.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from saltgate.store.errors import ConflictError, SchemaVersionError, StoreError
from saltgate.store.schema import (
    SCHEMA_VERSION,
    SQLITE_MIGRATIONS,
    SQLITE_VERSION_TABLE,
    newer_schema_message,
    older_schema_message,
    pending,
)
from saltgate.store.settings import Backend

BUSY_TIMEOUT_S = 10.0


def open_db(
    path: str | os.PathLike[str], *, check_same_thread: bool = True, upgrade: bool = False
) -> sqlite3.Connection:
    """Open the database (creating a new one at the current version, mode 0600);
    autocommit mode. An existing database at an older version is refused
    (SchemaVersionError) unless `upgrade` (`saltgate store migrate`), a newer one always.

    synchronous=NORMAL is durable against process crashes (see ledger.py).
    """
    p = Path(path)
    p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Create the file ourselves so it is never world-readable, whatever the umask. Only
    # when it is new: closing any descriptor of a file releases every POSIX lock this
    # process holds on it, so opening and closing an open database (the ledger's after the
    # key index's) would drop their locks; another process could then delete the WAL
    # index they map, and they would no longer see its commits
    # (https://www.sqlite.org/howtocorrupt.html, 2.2).
    with contextlib.suppress(FileExistsError):
        os.close(os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    conn = sqlite3.connect(
        p, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=check_same_thread
    )
    try:
        _use_wal(conn)
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        migrate(conn, upgrade=upgrade, where=str(p))
    except BaseException:
        conn.close()
        raise
    return conn


def _use_wal(conn: sqlite3.Connection) -> None:
    """Put the file in WAL mode, waiting (up to the busy timeout) for others converting it.

    The conversion needs the file alone, and while another connection holds it SQLite
    refuses at once with "database is locked" instead of running the busy handler: the
    workers of `saltgate serve --workers N` opening a new state directory together could
    lose one of them. WAL is a property of the file: once one has converted it, the
    others find it done.
    """
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    pause = 0.001
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            busy = exc.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY
            if not busy or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


def schema_version(conn: sqlite3.Connection) -> int:
    """The database's version (0: a new, empty one); ``user_version`` always equals it."""
    (version,) = conn.execute("PRAGMA user_version").fetchone()
    return int(version)


def read_schema_version(path: Path) -> int:
    """The version of the existing database at `path`, read without changing anything."""
    try:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            return schema_version(conn)
    except sqlite3.Error as exc:
        raise StoreError(f"store {path}: {exc}") from None


def _refuse_other_version(version: int, *, upgrade: bool, where: str) -> None:
    """A new database (0) is created; an older one is migrated only when asked to."""
    if version > SCHEMA_VERSION:
        raise SchemaVersionError(newer_schema_message(version))
    if 0 < version < SCHEMA_VERSION and not upgrade:
        raise SchemaVersionError(older_schema_message(where, version))


def migrate(conn: sqlite3.Connection, *, upgrade: bool = False, where: str = "") -> None:
    """Create a new database, or with `upgrade` apply an older one's missing migrations;
    atomically, BEGIN IMMEDIATE serialising racing processes. An older database without
    `upgrade`, and a newer one, are refused before any write (SchemaVersionError).

    The fast path is one pragma read: ``user_version`` always equals the version.
    """
    version = schema_version(conn)
    if version == SCHEMA_VERSION:
        return
    _refuse_other_version(version, upgrade=upgrade, where=where)
    with transaction(conn):
        version = schema_version(conn)  # another process may have created it meanwhile
        _refuse_other_version(version, upgrade=upgrade, where=where)
        conn.execute(SQLITE_VERSION_TABLE)
        recorded = {v for (v,) in conn.execute("SELECT version FROM schema_version")}
        # Databases from before the version table: record what user_version says was done.
        for m in SQLITE_MIGRATIONS:
            if m.version <= version and m.version not in recorded:
                conn.execute(
                    "INSERT INTO schema_version (version, name, applied_at) VALUES (?, ?, NULL)",
                    (m.version, m.name),
                )
        for m in pending(SQLITE_MIGRATIONS, version):
            for stmt in m.statements:
                conn.execute(stmt)
            conn.execute(
                "INSERT INTO schema_version (version, name, applied_at) VALUES (?, ?, ?)",
                (m.version, m.name, time.time()),
            )
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


@contextlib.contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE .. COMMIT, rolled back on any error."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


class SqliteDatabase:
    """The CLI's view of the SQLite file (`saltgate.store.db.Database`)."""

    backend: Backend = "sqlite"

    def __init__(
        self,
        path: str | os.PathLike[str],
        audit_key: bytes | None = None,
        *,
        upgrade: bool = False,
    ) -> None:
        self.path = Path(path)
        self.conn = open_db(self.path, upgrade=upgrade)
        self.audit_key = audit_key

    def describe(self) -> str:
        return str(self.path)

    def query(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        with self._errors():
            return self.conn.execute(sql, params).fetchall()

    def execute(self, sql: str, params: Sequence[object] = ()) -> None:
        self.query(sql, params)

    def execute_many(self, sql: str, rows: Iterable[Sequence[object]]) -> None:
        with self._errors():
            self.conn.executemany(sql, rows)

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """Driver errors as the store's: a conflict, or a safe message."""
        try:
            yield
        except sqlite3.IntegrityError as conflict:
            raise ConflictError(str(conflict)) from None
        except sqlite3.Error as exc:
            raise StoreError(f"store {self.path}: {exc}") from None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        with transaction(self.conn):
            yield

    @contextlib.contextmanager
    def read_snapshot(self) -> Iterator[None]:
        self.conn.execute("BEGIN")  # deferred: a WAL reader takes no write lock
        try:
            yield
        finally:
            self.conn.execute("COMMIT")

    def close(self) -> None:
        self.conn.close()
