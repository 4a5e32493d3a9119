"""Tenants, hashed API keys and salt epochs, on either backend (docs/store.md).

The CLI (another process) writes here; a running gateway reads a snapshot of the live keys
and refreshes it when something changes, so revocations and rotations take effect within
a second on every gateway without a restart: `KeyIndex` polls the SQLite file, and
saltgate.store.postgres.PgKeyIndex listens for PostgreSQL's notifications.

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
import hashlib
import hmac
import json
import os
import re
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Protocol

from saltgate.governance.limits import Limits
from saltgate.store.db import Database
from saltgate.store.errors import (
    ConflictError,
    KeyNotFoundError,
    KeyRevokedError,
    StoreError,
    TenantExistsError,
    TenantNotFoundError,
)
from saltgate.store.settings import DB_FILENAME
from saltgate.store.sqlite import SqliteDatabase, open_db

KEY_PREFIX = "sg_"
KEY_LENGTH = len(KEY_PREFIX) + 43  # 32 random bytes, base64url without padding
TENANT_ID_PREFIX = "tn_"
KEY_ID_PREFIX = "key_"

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_TENANT_ID_RE = re.compile(r"tn_[0-9a-f]{16}")
_KEY_ID_RE = re.compile(r"key_[0-9a-f]{12}")


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant: `id` is stable for life and feeds the cache-salt derivation with `epoch`."""

    id: str
    name: str
    epoch: int
    created_at: float
    models: tuple[str, ...] | None = None  # the models it may use; None: all
    limits: Limits | None = None  # its limits and budget; None: unlimited

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
    limits: Limits | None = None  # narrowing its tenant's; None: the tenant's alone


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is from, as the gateway needs it for salts and metering."""

    tenant_id: str
    tenant_name: str
    key_id: str
    epoch: int
    models: frozenset[str] | None = None  # the models it may use; None: all
    limits: Limits | None = None  # the tenant's limits; None: unlimited
    key_limits: Limits | None = None  # the key's own, narrowing the tenant's
    priority: str = "interactive"

    @property
    def epoch_label(self) -> str:
        """The epoch as the spec's derivation takes it (``lp(str(epoch))``)."""
        return str(self.epoch)


# The live keys with what a request needs of their tenant: the gateway's snapshot.
LIVE_KEYS_SQL = (
    "SELECT k.key_hash, t.id, t.name, k.id, t.epoch, t.allowed_models, t.limits, k.limits "
    "FROM api_keys k JOIN tenants t ON t.id = k.tenant_id "
    "WHERE k.revoked_at IS NULL"
)


_SELECT_TENANTS = "SELECT id, name, epoch, created_at, allowed_models, limits FROM tenants"
_SELECT_KEYS = "SELECT id, tenant_id, created_at, revoked_at, limits FROM api_keys"


def _allowed_models(stored: str | None) -> tuple[str, ...] | None:
    """The ``allowed_models`` column: NULL for every model, else a JSON array of names."""
    return None if stored is None else tuple(json.loads(stored))


def _tenant(row: tuple[str, str, int, float, str | None, str | None]) -> Tenant:
    tid, name, epoch, created_at, models, limits = row
    return Tenant(tid, name, epoch, created_at, _allowed_models(models), Limits.from_json(limits))


def _key(row: tuple[str, str, float, float | None, str | None]) -> ApiKeyInfo:
    kid, tid, created_at, revoked_at, limits = row
    return ApiKeyInfo(kid, tid, created_at, revoked_at, Limits.from_json(limits))


def db_path(state_dir: str | os.PathLike[str]) -> Path:
    """The database file inside a state directory."""
    return Path(state_dir) / DB_FILENAME


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
    """Administrative operations (the CLI's): tenants, keys, salt rotation, either backend.

    Give it a database path (SQLite) or an open `Database`
    (saltgate.store.backends.open_database builds one from `[store]` settings).
    """

    def __init__(self, target: str | os.PathLike[str] | Database) -> None:
        self._db: Database = (
            SqliteDatabase(target) if isinstance(target, str | os.PathLike) else target
        )

    @classmethod
    def from_state_dir(cls, state_dir: str | os.PathLike[str]) -> TenantStore:
        """Open ``state_dir/saltgate.db``."""
        return cls(db_path(state_dir))

    def close(self) -> None:
        self._db.close()

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
            with self._db.transaction():
                self._db.execute(
                    "INSERT INTO tenants (id, name, epoch, created_at) VALUES (?, ?, ?, ?)",
                    (tenant.id, tenant.name, tenant.epoch, tenant.created_at),
                )
        except ConflictError as exc:
            if self._find_tenant(name) is not None:
                raise TenantExistsError(f"tenant {name!r} already exists") from None
            raise StoreError(f"could not create tenant {name!r}: {exc}") from None
        return tenant

    def list_tenants(self) -> list[Tenant]:
        """All tenants, by name."""
        rows = self._db.query(_SELECT_TENANTS + " ORDER BY name")
        return [_tenant(row) for row in rows]

    def get_tenant(self, tenant: str) -> Tenant:
        """Look a tenant up by id (``tn_...``) or name."""
        found = self._find_tenant(tenant)
        if found is None:
            raise TenantNotFoundError(
                f"no such tenant: {_describe_ref(tenant, _NAME_RE, 'tenant name or id')}"
            )
        return found

    def _find_tenant(self, ref: str) -> Tenant | None:
        rows = self._db.query(_SELECT_TENANTS + " WHERE id = ? OR name = ?", (ref, ref))
        return _tenant(rows[0]) if rows else None

    def rotate_salt(self, tenant: str) -> int:
        """Move the tenant to a fresh cache namespace; returns the new epoch.

        Its old cache entries become unreachable (they age out of the replicas' LRU).
        """
        with self._db.transaction():
            t = self.get_tenant(tenant)
            self._db.execute("UPDATE tenants SET epoch = epoch + 1 WHERE id = ?", (t.id,))
            [(epoch,)] = self._db.query("SELECT epoch FROM tenants WHERE id = ?", (t.id,))
        return int(epoch)

    def set_models(self, tenant: str, models: Iterable[str] | None) -> Tenant:
        """Let the tenant use only ``models`` (None: every model); every gateway follows
        within a second, as it does a key change (the auth generation moves)."""
        names = None
        if models is not None:
            names = tuple(sorted(set(models)))
            if not names or not all(n and n == n.strip() for n in names):
                raise StoreError(
                    "invalid model list: give one or more model names without spaces around "
                    "them (or every model: --all)"
                )
        stored = None if names is None else json.dumps(list(names))
        with self._db.transaction():
            t = self.get_tenant(tenant)
            self._db.execute("UPDATE tenants SET allowed_models = ? WHERE id = ?", (stored, t.id))
        return Tenant(t.id, t.name, t.epoch, t.created_at, names, t.limits)

    def set_limits(self, tenant: str, limits: Limits | None) -> Tenant:
        """Replace the tenant's limits (None or empty: unlimited); every gateway follows
        within a second, as it does a key change (the auth generation moves)."""
        stored = None if limits is None else limits.to_json()
        with self._db.transaction():
            t = self.get_tenant(tenant)
            self._db.execute("UPDATE tenants SET limits = ? WHERE id = ?", (stored, t.id))
        return Tenant(t.id, t.name, t.epoch, t.created_at, t.models, Limits.from_json(stored))

    def set_key_limits(self, key_id: str, limits: Limits | None) -> ApiKeyInfo:
        """Replace a key's own limits, which narrow its tenant's (None: the tenant's)."""
        stored = None if limits is None else limits.to_json()
        with self._db.transaction():
            info = self._get_key(key_id)
            self._db.execute("UPDATE api_keys SET limits = ? WHERE id = ?", (stored, key_id))
        return ApiKeyInfo(
            info.id, info.tenant_id, info.created_at, info.revoked_at, Limits.from_json(stored)
        )

    def _get_key(self, key_id: str) -> ApiKeyInfo:
        rows = self._db.query(_SELECT_KEYS + " WHERE id = ?", (key_id,))
        if not rows:
            raise KeyNotFoundError(f"no such {_describe_ref(key_id, _KEY_ID_RE, 'key id')}")
        return _key(rows[0])

    # keys

    def create_key(self, tenant: str) -> tuple[str, str]:
        """Mint a key for a tenant (by name or id); returns ``(key_id, key)``.

        The key is shown once: only its SHA-256 is stored.
        """
        key = new_api_key()
        key_id = KEY_ID_PREFIX + secrets.token_hex(6)
        with self._db.transaction():
            t = self.get_tenant(tenant)
            self._db.execute(
                "INSERT INTO api_keys (id, tenant_id, key_hash, created_at) VALUES (?, ?, ?, ?)",
                (key_id, t.id, hash_api_key(key), time.time()),
            )
        return key_id, key

    def list_keys(self, tenant: str | None = None) -> list[ApiKeyInfo]:
        """Key metadata (never the keys), optionally of one tenant, oldest first."""
        if tenant is None:
            rows = self._db.query(_SELECT_KEYS + " ORDER BY created_at")
        else:
            t = self.get_tenant(tenant)
            rows = self._db.query(
                _SELECT_KEYS + " WHERE tenant_id = ? ORDER BY created_at", (t.id,)
            )
        return [_key(row) for row in rows]

    def revoke_key(self, key_id: str) -> ApiKeyInfo:
        """Revoke a key by its id; the tenant (and its warm cache) is untouched."""
        with self._db.transaction():
            info = self._get_key(key_id)
            if info.revoked_at is not None:
                raise KeyRevokedError(f"key id {key_id!r} was already revoked")
            now = time.time()
            self._db.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ?", (now, key_id))
        return ApiKeyInfo(info.id, info.tenant_id, info.created_at, now, info.limits)


# --------------------------------------------------------------------------- hot path


class KeySource(Protocol):
    """What the gateway authenticates against: `KeyIndex` (SQLite) or PgKeyIndex."""

    def authenticate(self, presented: str) -> Principal | None:
        """The principal of a live key, or None; StoreUnavailableError once the store has
        been out of reach for longer than the gateway may authenticate without it."""
        ...

    async def aclose(self) -> None: ...


class KeySnapshot:
    """The live keys by SHA-256 digest: what `authenticate` consults, on either backend."""

    __slots__ = ("_by_hash",)

    def __init__(
        self,
        rows: Iterable[tuple[bytes, str, str, str, int, str | None, str | None, str | None]] = (),
    ) -> None:
        """`rows` as LIVE_KEYS_SQL returns them."""
        allowed: dict[str, frozenset[str] | None] = {}  # one set per tenant, not per key
        limits: dict[str, Limits | None] = {}
        self._by_hash: dict[bytes, tuple[bytes, Principal]] = {}
        for h, tid, tname, kid, epoch, models, tenant_limits, key_limits in rows:
            if tid not in allowed:
                names = _allowed_models(models)
                allowed[tid] = None if names is None else frozenset(names)
                limits[tid] = Limits.from_json(tenant_limits)
            principal = Principal(
                tid,
                tname,
                kid,
                int(epoch),
                allowed[tid],
                limits[tid],
                Limits.from_json(key_limits),
            )
            self._by_hash[bytes(h)] = (bytes(h), principal)

    def __len__(self) -> int:
        return len(self._by_hash)

    def lookup(self, presented: str) -> Principal | None:
        """The principal of a live key, or None.

        The dict lookup compares SHA-256 digests, never the secret, so its timing tells an
        attacker only about digests of their own guesses (useless without a preimage);
        `hmac.compare_digest` then confirms the full digest in constant time.
        """
        if not _looks_like_key(presented):
            return None
        digest = hash_api_key(presented)
        entry = self._by_hash.get(digest)
        if entry is None:
            return None
        stored, principal = entry
        return principal if hmac.compare_digest(stored, digest) else None


class KeyIndex:
    """The gateway's snapshot of the live keys in a SQLite store.

    `authenticate` is a hash plus a dict lookup; the snapshot is reloaded when the
    database's auth generation changes (checked at most every `max_staleness` seconds
    from `authenticate`, or whenever `refresh_if_changed` is called). Use from one thread.
    """

    def __init__(self, path: str | os.PathLike[str], *, max_staleness: float | None = 0.5) -> None:
        self.path = Path(path)
        self.max_staleness = max_staleness
        self._conn = open_db(self.path)
        self._keys = KeySnapshot()
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

    async def aclose(self) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._keys)

    def authenticate(self, presented: str) -> Principal | None:
        """The principal of a live key, or None (see `KeySnapshot.lookup`)."""
        if self.max_staleness is not None:
            now = time.monotonic()
            if now - self._checked_at >= self.max_staleness:
                self.refresh_if_changed()
        return self._keys.lookup(presented)

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
            rows = self._conn.execute(LIVE_KEYS_SQL).fetchall()
        finally:
            self._conn.execute("COMMIT")
        self._keys = KeySnapshot(rows)
        self._generation = generation
        self.reloads += 1
