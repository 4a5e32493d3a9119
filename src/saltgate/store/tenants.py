"""Tenants, hashed API keys and salt epochs in one SQLite file under the state directory.

The CLI (another process) writes here; a running gateway reads a `KeyIndex` snapshot and
refreshes it when the CLI changes something, so revocations and rotations take effect
within about a second without a restart.

Why SHA-256 and no slow KDF: a key is ``"sg_"`` + 32 random bytes (256 bits of entropy).
Slow, salted KDFs exist to make guessing *low-entropy* passwords expensive; nobody can
enumerate 2**256 candidates at any hash speed, so a leaked hash table reveals no key, and a
fast hash keeps authentication cheap on the request path. No per-key salt is needed either:
precomputed tables are useless against 256-bit random inputs, and an unsalted digest lets
the gateway find a key by its hash in O(1).

Keys exist in clear only in the return value of `TenantStore.create_key`; they are never
stored, logged, or echoed in an error message.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import os
import re
import secrets
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

DB_FILENAME = "saltgate.db"
KEY_PREFIX = "sg_"
KEY_LENGTH = len(KEY_PREFIX) + 43  # 32 random bytes, base64url without padding
TENANT_ID_PREFIX = "tn_"
KEY_ID_PREFIX = "key_"
BUSY_TIMEOUT_S = 10.0

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_TENANT_ID_RE = re.compile(r"tn_[0-9a-f]{16}")
_KEY_ID_RE = re.compile(r"key_[0-9a-f]{12}")


class StoreError(Exception):
    """A store operation failed for a reason the operator can act on (message is safe)."""


class TenantExistsError(StoreError):
    """`create_tenant` was given a name that is already taken."""


class TenantNotFoundError(StoreError):
    """No tenant has the given name or id."""


class KeyNotFoundError(StoreError):
    """No API key has the given key id."""


class KeyRevokedError(StoreError):
    """The key id names a key that was already revoked."""


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant: `id` is stable for life and feeds the cache-salt derivation with `epoch`."""

    id: str
    name: str
    epoch: int
    created_at: float

    @property
    def epoch_label(self) -> str:
        """The epoch as the spec's derivation takes it (``lp(str(epoch))``)."""
        return str(self.epoch)


@dataclass(frozen=True, slots=True)
class ApiKeyInfo:
    """Metadata of one API key; the key itself is not recoverable."""

    id: str
    tenant_id: str
    created_at: float
    revoked_at: float | None


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is from, as the gateway needs it for salts and metering."""

    tenant_id: str
    tenant_name: str
    key_id: str
    epoch: int

    @property
    def epoch_label(self) -> str:
        """The epoch as the spec's derivation takes it (``lp(str(epoch))``)."""
        return str(self.epoch)


# --------------------------------------------------------------------------- schema

# One tuple of statements per schema version; user_version = number applied. Append only.
# Statements run one by one inside a single transaction (executescript would commit early).
_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        # auth_generation changes on every tenant/key mutation (triggers below), so a gateway
        # can tell "auth data changed" from "usage rows were appended" with one tiny read.
        """CREATE TABLE meta (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            auth_generation INTEGER NOT NULL
        )""",
        "INSERT INTO meta (id, auth_generation) VALUES (1, 0)",
        """CREATE TABLE tenants (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL UNIQUE,
            epoch INTEGER NOT NULL DEFAULT 0 CHECK (epoch >= 0),
            created_at REAL NOT NULL
        )""",
        """CREATE TABLE api_keys (
            id TEXT PRIMARY KEY,
            tenant_id TEXT NOT NULL REFERENCES tenants(id),
            key_hash BLOB NOT NULL UNIQUE CHECK (length(key_hash) = 32),
            created_at REAL NOT NULL,
            revoked_at REAL
        )""",
        "CREATE INDEX api_keys_tenant ON api_keys(tenant_id)",
        "CREATE TRIGGER tenants_insert_bump AFTER INSERT ON tenants "
        "BEGIN UPDATE meta SET auth_generation = auth_generation + 1; END",
        "CREATE TRIGGER tenants_update_bump AFTER UPDATE ON tenants "
        "BEGIN UPDATE meta SET auth_generation = auth_generation + 1; END",
        "CREATE TRIGGER tenants_delete_bump AFTER DELETE ON tenants "
        "BEGIN UPDATE meta SET auth_generation = auth_generation + 1; END",
        "CREATE TRIGGER api_keys_insert_bump AFTER INSERT ON api_keys "
        "BEGIN UPDATE meta SET auth_generation = auth_generation + 1; END",
        "CREATE TRIGGER api_keys_update_bump AFTER UPDATE ON api_keys "
        "BEGIN UPDATE meta SET auth_generation = auth_generation + 1; END",
        "CREATE TRIGGER api_keys_delete_bump AFTER DELETE ON api_keys "
        "BEGIN UPDATE meta SET auth_generation = auth_generation + 1; END",
        # Usage rows (written by ledger.Ledger). No foreign key: metering must never fail
        # because a tenant was edited, and the check would cost every insert.
        """CREATE TABLE usage (
            id INTEGER PRIMARY KEY,
            ts REAL NOT NULL,
            tenant_id TEXT NOT NULL,
            key_id TEXT NOT NULL,
            model TEXT NOT NULL,
            prompt_tokens INTEGER NOT NULL,
            cached_tokens INTEGER NOT NULL,
            completion_tokens INTEGER NOT NULL,
            status INTEGER NOT NULL
        )""",
        "CREATE INDEX usage_ts ON usage(ts)",
    ),
    (
        # The ts index cost more than the row itself on every ledger commit (one more page
        # per commit: 47 -> 20 us for a one-row commit, 135 -> 52 us for 13 rows, on this
        # machine); usage reports aggregate by scanning instead (docs/benchmarks.md).
        "DROP INDEX usage_ts",
    ),
)
SCHEMA_VERSION = len(_MIGRATIONS)


def db_path(state_dir: str | os.PathLike[str]) -> Path:
    """The database file inside a state directory."""
    return Path(state_dir) / DB_FILENAME


def open_db(path: str | os.PathLike[str], *, check_same_thread: bool = True) -> sqlite3.Connection:
    """Open (creating if needed, mode 0600) and migrate the database; autocommit mode.

    WAL lets the gateway's reader and ledger writer run alongside CLI writes;
    synchronous=NORMAL is durable against process crashes (see ledger.py).
    """
    p = Path(path)
    p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Create the file ourselves so it is never world-readable, whatever the umask.
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)
    conn = sqlite3.connect(
        p, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=check_same_thread
    )
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        _migrate(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def _migrate(conn: sqlite3.Connection) -> None:
    """Apply missing migrations atomically; BEGIN IMMEDIATE serialises racing processes."""
    (version,) = conn.execute("PRAGMA user_version").fetchone()
    if version == SCHEMA_VERSION:
        return
    with _transaction(conn):
        (version,) = conn.execute("PRAGMA user_version").fetchone()
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"database schema version {version} is newer than this saltgate "
                f"supports ({SCHEMA_VERSION}); upgrade saltgate"
            )
        for statements in _MIGRATIONS[version:]:
            for stmt in statements:
                conn.execute(stmt)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE .. COMMIT, rolled back on any error."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


# --------------------------------------------------------------------------- keys


def new_api_key() -> str:
    """A fresh API key: ``sg_`` + 43 base64url characters (32 random bytes)."""
    raw = secrets.token_bytes(32)
    return KEY_PREFIX + base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def hash_api_key(key: str) -> bytes:
    """SHA-256 of the key's ASCII bytes: the only form a key is stored in."""
    return hashlib.sha256(key.encode("ascii")).digest()


def _looks_like_key(presented: str) -> bool:
    """Cheap shape check; the shape is public, so rejecting early leaks nothing."""
    return len(presented) == KEY_LENGTH and presented.startswith(KEY_PREFIX) and presented.isascii()


def _describe_ref(ref: str, pattern: re.Pattern[str], what: str) -> str:
    """Echo a user-given reference only if it has the expected shape, so a key pasted into
    the wrong argument never ends up in an error message or a log."""
    if ref.startswith(KEY_PREFIX):
        return f"{what} (that argument looks like an API key, not a {what}; not shown)"
    if pattern.fullmatch(ref):
        return f"{what} {ref!r}"
    return f"{what} (argument not shown: not a valid {what})"


# --------------------------------------------------------------------------- store


class TenantStore:
    """Administrative operations (the CLI's): tenants, keys, salt rotation."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._conn = open_db(self.path)

    @classmethod
    def from_state_dir(cls, state_dir: str | os.PathLike[str]) -> TenantStore:
        """Open ``state_dir/saltgate.db``."""
        return cls(db_path(state_dir))

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> TenantStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # tenants

    def create_tenant(self, name: str) -> Tenant:
        """Create a tenant with a fresh random id and epoch 0."""
        if not _NAME_RE.fullmatch(name) or name.startswith((TENANT_ID_PREFIX, KEY_PREFIX)):
            raise StoreError(
                "invalid tenant name: use 1-64 characters of [A-Za-z0-9._-], starting with a "
                f"letter or digit, not starting with {TENANT_ID_PREFIX!r} or {KEY_PREFIX!r} "
                "(reserved for tenant ids and API keys)"
            )
        tenant = Tenant(
            id=TENANT_ID_PREFIX + secrets.token_hex(8), name=name, epoch=0, created_at=time.time()
        )
        try:
            with _transaction(self._conn):
                self._conn.execute(
                    "INSERT INTO tenants (id, name, epoch, created_at) VALUES (?, ?, ?, ?)",
                    (tenant.id, tenant.name, tenant.epoch, tenant.created_at),
                )
        except sqlite3.IntegrityError as exc:
            if self._find_tenant(name) is not None:
                raise TenantExistsError(f"tenant {name!r} already exists") from None
            raise StoreError(f"could not create tenant {name!r}: {exc}") from None
        return tenant

    def list_tenants(self) -> list[Tenant]:
        """All tenants, by name."""
        rows = self._conn.execute(
            "SELECT id, name, epoch, created_at FROM tenants ORDER BY name"
        ).fetchall()
        return [Tenant(*row) for row in rows]

    def get_tenant(self, tenant: str) -> Tenant:
        """Look a tenant up by id (``tn_...``) or name."""
        found = self._find_tenant(tenant)
        if found is None:
            raise TenantNotFoundError(
                f"no such tenant: {_describe_ref(tenant, _NAME_RE, 'tenant name or id')}"
            )
        return found

    def _find_tenant(self, ref: str) -> Tenant | None:
        row = self._conn.execute(
            "SELECT id, name, epoch, created_at FROM tenants WHERE id = ? OR name = ?",
            (ref, ref),
        ).fetchone()
        return None if row is None else Tenant(*row)

    def rotate_salt(self, tenant: str) -> int:
        """Move the tenant to a fresh cache namespace; returns the new epoch.

        Its old cache entries become unreachable (they age out of the replicas' LRU).
        """
        with _transaction(self._conn):
            t = self.get_tenant(tenant)
            self._conn.execute("UPDATE tenants SET epoch = epoch + 1 WHERE id = ?", (t.id,))
            (epoch,) = self._conn.execute(
                "SELECT epoch FROM tenants WHERE id = ?", (t.id,)
            ).fetchone()
        return int(epoch)

    # keys

    def create_key(self, tenant: str) -> tuple[str, str]:
        """Mint a key for a tenant (by name or id); returns ``(key_id, key)``.

        The key is shown once: only its SHA-256 is stored.
        """
        key = new_api_key()
        key_id = KEY_ID_PREFIX + secrets.token_hex(6)
        with _transaction(self._conn):
            t = self.get_tenant(tenant)
            self._conn.execute(
                "INSERT INTO api_keys (id, tenant_id, key_hash, created_at) VALUES (?, ?, ?, ?)",
                (key_id, t.id, hash_api_key(key), time.time()),
            )
        return key_id, key

    def list_keys(self, tenant: str | None = None) -> list[ApiKeyInfo]:
        """Key metadata (never the keys), optionally of one tenant, oldest first."""
        if tenant is None:
            rows = self._conn.execute(
                "SELECT id, tenant_id, created_at, revoked_at FROM api_keys ORDER BY created_at"
            ).fetchall()
        else:
            t = self.get_tenant(tenant)
            rows = self._conn.execute(
                "SELECT id, tenant_id, created_at, revoked_at FROM api_keys "
                "WHERE tenant_id = ? ORDER BY created_at",
                (t.id,),
            ).fetchall()
        return [ApiKeyInfo(*row) for row in rows]

    def revoke_key(self, key_id: str) -> ApiKeyInfo:
        """Revoke a key by its id; the tenant (and its warm cache) is untouched."""
        with _transaction(self._conn):
            row = self._conn.execute(
                "SELECT id, tenant_id, created_at, revoked_at FROM api_keys WHERE id = ?",
                (key_id,),
            ).fetchone()
            if row is None:
                raise KeyNotFoundError(f"no such {_describe_ref(key_id, _KEY_ID_RE, 'key id')}")
            info = ApiKeyInfo(*row)
            if info.revoked_at is not None:
                raise KeyRevokedError(f"key id {key_id!r} was already revoked")
            now = time.time()
            self._conn.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ?", (now, key_id))
        return ApiKeyInfo(info.id, info.tenant_id, info.created_at, now)


# --------------------------------------------------------------------------- hot path


class KeyIndex:
    """In-memory snapshot of the live keys for the gateway's request path.

    `authenticate` is a hash plus a dict lookup; the snapshot is reloaded when the
    database's auth generation changes (checked at most every `max_staleness` seconds
    from `authenticate`, or whenever `refresh_if_changed` is called). Use from one thread.
    """

    def __init__(self, path: str | os.PathLike[str], *, max_staleness: float | None = 0.5) -> None:
        self.path = Path(path)
        self.max_staleness = max_staleness
        self._conn = open_db(self.path)
        self._by_hash: dict[bytes, tuple[bytes, Principal]] = {}
        self._data_version = -1
        self._generation = -1
        self._checked_at = 0.0
        self.reloads = 0
        self.refresh_if_changed()

    @classmethod
    def from_state_dir(
        cls, state_dir: str | os.PathLike[str], *, max_staleness: float | None = 0.5
    ) -> KeyIndex:
        return cls(db_path(state_dir), max_staleness=max_staleness)

    def close(self) -> None:
        self._conn.close()

    def __len__(self) -> int:
        return len(self._by_hash)

    def authenticate(self, presented: str) -> Principal | None:
        """The principal of a live key, or None.

        The dict lookup compares SHA-256 digests, never the secret, so its timing tells an
        attacker only about digests of their own guesses (useless without a preimage);
        `hmac.compare_digest` then confirms the full digest in constant time.
        """
        if self.max_staleness is not None:
            now = time.monotonic()
            if now - self._checked_at >= self.max_staleness:
                self.refresh_if_changed()
        if not _looks_like_key(presented):
            return None
        digest = hash_api_key(presented)
        entry = self._by_hash.get(digest)
        if entry is None:
            return None
        stored, principal = entry
        return principal if hmac.compare_digest(stored, digest) else None

    def refresh_if_changed(self) -> bool:
        """Reload if tenants or keys changed since the last load; True if reloaded.

        Cheap enough to call per request: ``PRAGMA data_version`` answers from the
        connection without touching the tables, and only when some other connection has
        committed (e.g. the ledger appending usage) is the one-row generation read.
        """
        self._checked_at = time.monotonic()
        (data_version,) = self._conn.execute("PRAGMA data_version").fetchone()
        if data_version == self._data_version:
            return False
        self._data_version = data_version
        (generation,) = self._conn.execute(
            "SELECT auth_generation FROM meta WHERE id = 1"
        ).fetchone()
        if generation == self._generation:
            return False
        self._reload()
        return True

    def _reload(self) -> None:
        """Read generation and live keys in one read transaction (a consistent snapshot)."""
        self._conn.execute("BEGIN")
        try:
            (generation,) = self._conn.execute(
                "SELECT auth_generation FROM meta WHERE id = 1"
            ).fetchone()
            rows = self._conn.execute(
                "SELECT k.key_hash, t.id, t.name, k.id, t.epoch "
                "FROM api_keys k JOIN tenants t ON t.id = k.tenant_id "
                "WHERE k.revoked_at IS NULL"
            ).fetchall()
        finally:
            self._conn.execute("COMMIT")
        self._by_hash = {
            bytes(h): (bytes(h), Principal(tid, tname, kid, int(epoch)))
            for h, tid, tname, kid, epoch in rows
        }
        self._generation = generation
        self.reloads += 1
